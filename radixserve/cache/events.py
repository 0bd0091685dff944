"""KV events: a drainable record of what a cache stored and removed.

A consumer (a cache-aware router, a metrics exporter) drains the log and can
rebuild the set of cached pages. Events name content, not node ids: a range of
token positions ``[start, end)`` of a key (the tokens that lead to it, in their
namespaces), so a node split (which changes ids, not content) needs no event.
Page hashes are chained exactly like the block cache's and computed only when read.

A lower cache tier (L2 host, L3 disk) announces one tier page at a time, named
by its hash (``page_hash`` set, an empty key): a ``remove`` needs nothing else; a
``store`` carries the page's ``PageLabel`` (its parent's hash and its own tokens),
kept beside the page in L2 and in its file's header on disk, so a page that moves
down a tier (L2 spilling to L3) or up one (a prefetch into L2), or that a restart
finds on disk, is announced as fully as a page copied straight from the pool. Only
a version 1 disk file keeps no label: its ``store`` names only its hash.

Off by default: a cache built without a log among its ``listeners`` records nothing (and,
with no listener at all, pays one emptiness check per insert and eviction).

One thread records and drains (the step loop's). Events that other threads
cause (the disk writer's evictions, the prefetcher's) wait in their owner's
thread-safe inbox, which a *source* registered here turns into events at the
start of every ``drain``, on the draining thread.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from radixserve.cache.core.key import RadixKey, TokenArray
from radixserve.memory.allocator import IndexArray

EventKind = Literal["store", "remove", "clear"]  # clear: everything cached is gone (reset)


@dataclass(frozen=True, eq=False)
class PageLabel:
    """What one tier page holds, as a ``BlockStored`` names it: enough to announce it without its path."""

    parent_hash: bytes | None  # the previous page's chained hash; None for a sequence's first page
    token_ids: TokenArray  # the page's own tokens
    extra_key: str | None
    shared_len: int  # the sequence's shared head, counted up to this page's end (as a key that ends here)


@dataclass(frozen=True, eq=False)
class KVEvent:
    """``kind`` of the pages covering token positions ``[start, end)`` of ``key``."""

    seq: int
    kind: EventKind
    start: int
    key: RadixKey  # tokens [0, end): the range and everything before it
    page_size: int
    medium: str | None = None  # None: the KV pool; "cpu" / "disk": a page copied down into that tier
    page_hash: bytes | None = None  # one tier page (``page_size`` tokens), stored or dropped; ``key`` is then empty
    label: PageLabel | None = None  # what a stored tier page holds (None: unknown, a version 1 disk file's page)
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
        if self.page_hash is not None:
            return [self.page_hash]
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
        self._sources: list[Callable[[], None]] = []

    def record(self, kind: EventKind, start: int, key: RadixKey, medium: str | None = None) -> None:
        """Record that tokens ``key[start:]`` were stored or removed (``key`` is copied)."""
        self._seq += 1
        self._queue.append(KVEvent(self._seq, kind, start, key.copy(), self.page_size, medium))

    def record_clear(self) -> None:
        """Record that the whole cache was dropped (``reset``): a consumer forgets everything."""
        self._seq += 1
        self._queue.append(KVEvent(self._seq, "clear", 0, RadixKey(np.empty(0, dtype=np.int64)), self.page_size))

    def record_drop(self, page_hash: bytes, page_size: int, medium: str) -> None:
        """Record that the tier ``medium`` dropped the ``page_size``-token page named ``page_hash``."""
        self._seq += 1
        empty = RadixKey(np.empty(0, dtype=np.int64))
        self._queue.append(KVEvent(self._seq, "remove", 0, empty, page_size, medium, page_hash))

    def record_page(self, page_hash: bytes, page_size: int, medium: str, label: PageLabel | None) -> None:
        """Record that the tier ``medium`` now holds the ``page_size``-token page named ``page_hash``, holding
        ``label`` (None: what it holds is unknown, a page found at a start in a file that keeps no label)."""
        self._seq += 1
        empty = RadixKey(np.empty(0, dtype=np.int64))
        self._queue.append(KVEvent(self._seq, "store", 0, empty, page_size, medium, page_hash, label))

    # ---- as a cache's listener (core/listener.py): what the pool stores and removes ----------------

    def on_insert(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        self.record("store", start, key)

    def on_evict(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        self.record("remove", start, key)

    def on_clear(self) -> None:
        self.record_clear()

    def add_source(self, source: Callable[[], None]) -> None:
        """Call ``source()`` at the start of every drain: it records what other threads left for it."""
        self._sources.append(source)

    def drain(self) -> list[KVEvent]:
        """Every event recorded since the last drain (and what the sources record now), oldest first."""
        for source in self._sources:
            source()
        events = list(self._queue)
        self._queue.clear()
        return events

    def __len__(self) -> int:
        return len(self._queue)
