"""KV events: a drainable record of what a cache stored and removed.

A consumer (a cache-aware router, a metrics exporter) drains the log and can
rebuild the set of cached pages. Events name content, not node ids: a range of
token positions ``[start, end)`` under a namespace, with the tokens that lead to
it, so a node split (which changes ids, not content) needs no event. Page hashes
are chained exactly like the block cache's and computed only when read.

Off by default: a cache built with ``events=None`` pays one ``is None`` check.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from radixserve.cache.key import TokenArray, page_hashes

EventKind = Literal["store", "remove", "clear"]  # clear: everything cached is gone (reset)


@dataclass(frozen=True, eq=False)
class KVEvent:
    """``kind`` of the pages covering token positions ``[start, end)`` of ``prefix``."""

    seq: int
    kind: EventKind
    extra_key: str | None
    start: int
    end: int
    prefix: TokenArray  # tokens [0, end): the range and everything before it
    page_size: int
    shared_len: int = 0  # prefix[:shared_len] is in the shared namespace (an allowlisted public head)
    _hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def token_ids(self) -> TokenArray:
        return self.prefix[self.start : self.end]

    @property
    def block_hashes(self) -> list[bytes]:
        """Chained page hashes of the pages in ``[start, end)``, computed on first read."""
        if not self._hashes:
            hashes = page_hashes(self.prefix[: self.end], self.extra_key, self.page_size, shared_len=self.shared_len)
            self._hashes.extend(itertools.islice(hashes, self.start // self.page_size, None))
        return self._hashes


class KVEventLog:
    """An append-only queue of KVEvents with a running sequence number."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._queue: deque[KVEvent] = deque()
        self._seq = 0

    def record(
        self, kind: EventKind, extra_key: str | None, start: int, prefix: TokenArray, shared_len: int = 0
    ) -> None:
        """Record that tokens ``prefix[start:]`` were stored or removed (``prefix`` is copied)."""
        self._seq += 1
        event = KVEvent(self._seq, kind, extra_key, start, len(prefix), prefix.copy(), self.page_size, shared_len)
        self._queue.append(event)

    def record_clear(self) -> None:
        """Record that the whole cache was dropped (``reset``): a consumer forgets everything."""
        self._seq += 1
        self._queue.append(KVEvent(self._seq, "clear", None, 0, 0, np.empty(0, dtype=np.int64), self.page_size))

    def drain(self) -> list[KVEvent]:
        """Every event recorded since the last drain, oldest first."""
        events = list(self._queue)
        self._queue.clear()
        return events

    def __len__(self) -> int:
        return len(self._queue)
