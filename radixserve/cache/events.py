"""KV events: a drainable record of what a cache stored and removed.

A consumer (a cache-aware router, a metrics exporter) drains the log and can
rebuild the set of cached pages. Events name content, not node ids: a range of
token positions ``[start, end)`` of a key (the tokens that lead to it, in their
namespaces), so a node split (which changes ids, not content) needs no event.
Page hashes are chained exactly like the block cache's and computed only when read.

Off by default: a cache built with ``events=None`` pays one ``is None`` check.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from radixserve.cache.key import RadixKey, TokenArray

EventKind = Literal["store", "remove", "clear"]  # clear: everything cached is gone (reset)


@dataclass(frozen=True, eq=False)
class KVEvent:
    """``kind`` of the pages covering token positions ``[start, end)`` of ``key``."""

    seq: int
    kind: EventKind
    start: int
    key: RadixKey  # tokens [0, end): the range and everything before it
    page_size: int
    medium: str | None = None  # None: the KV pool; "cpu" / "disk": a page copied down into that tier
    _hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def end(self) -> int:
        return len(self.key)

    @property
    def extra_key(self) -> str | None:
        return self.key.extra_key

    @property
    def token_ids(self) -> TokenArray:
        return self.key.token_ids[self.start :]

    @property
    def block_hashes(self) -> list[bytes]:
        """Chained page hashes of the pages in ``[start, end)``, computed on first read."""
        if not self._hashes:
            hashes = self.key.page_hashes(self.page_size)
            self._hashes.extend(itertools.islice(hashes, self.start // self.page_size, None))
        return self._hashes


class KVEventLog:
    """An append-only queue of KVEvents with a running sequence number."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._queue: deque[KVEvent] = deque()
        self._seq = 0

    def record(self, kind: EventKind, start: int, key: RadixKey, medium: str | None = None) -> None:
        """Record that tokens ``key[start:]`` were stored or removed (``key`` is copied)."""
        self._seq += 1
        self._queue.append(KVEvent(self._seq, kind, start, key.copy(), self.page_size, medium))

    def record_clear(self) -> None:
        """Record that the whole cache was dropped (``reset``): a consumer forgets everything."""
        self._seq += 1
        self._queue.append(KVEvent(self._seq, "clear", 0, RadixKey(np.empty(0, dtype=np.int64)), self.page_size))

    def drain(self) -> list[KVEvent]:
        """Every event recorded since the last drain, oldest first."""
        events = list(self._queue)
        self._queue.clear()
        return events

    def __len__(self) -> int:
        return len(self._queue)
