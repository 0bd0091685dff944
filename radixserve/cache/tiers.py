"""The tier index: where a cached page lives below the KV pool (L2 host, L3 disk), and moving it.

The tree holds L1 only (slot indices). A page leaving L1 is *demoted*: its K/V
is copied, under its chained page hash, into the host arena (L2), whose LRU
victims spill to the disk store (L3). ``match_continuation`` finds, after the
part of a key the tree matched, the run of pages still held in L2 or L3, so
admission copies them back into fresh slots instead of recomputing them.

Tier pages are ``page_tokens`` long (a multiple of the cache's page, at least
16 tokens: one file per token would be absurd). Their hash is the KV events'
chained page hash, namespace folded in, with the shared head counted only in
whole tier pages: a page that mixes a public head and private tokens is
private, so no tier ever answers one tenant with another's page.

Write policies (SGLang's names): ``write_back`` copies a page down only when
L1 evicts it (and to disk when L2 evicts it, or at shutdown); ``write_through``
copies every page to L2 and L3 as soon as the tree caches it, so a crash loses
nothing that reached the disk queue.

Prefetch (with both L2 and L3): a request entering the waiting queue has its
disk-only continuation read into L2 by a thread (cache/prefetch.py), so
admission copies from host memory. ``lock`` guards the host arena and the
prefetch bookkeeping; the disk store locks itself.

Per tier and page, one state: L1 cached or not; L2 present or not; L3 absent,
queued (bytes held by the writer) or on disk. See ``page_states``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from radixserve.cache.events import KVEventLog
from radixserve.cache.key import RadixKey, page_hashes
from radixserve.cache.prefetch import Prefetcher
from radixserve.memory.allocator import IndexArray

if TYPE_CHECKING:  # torch stays out of the cache layer's imports
    from radixserve.memory.disk_store import DiskPageStore
    from radixserve.memory.host_arena import HostArena

WRITE_POLICIES = ("write_back", "write_through")
WritePolicy = Literal["write_back", "write_through"]
TierName = Literal["host", "disk"]
LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class PageMover(Protocol):
    """Copies between the KV pool and opaque tier pages (memory/kv_pages.py over a KVPool)."""

    def gather(self, slots: IndexArray) -> Any: ...
    def split_pages(self, rows: Any) -> Sequence[Any]: ...
    def scatter_pages(self, slots: IndexArray, pages: Sequence[Any], first: int) -> None: ...
    def to_bytes(self, page: Any) -> bytes: ...
    def from_bytes(self, data: bytes) -> Any: ...


@dataclass
class TierStats:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_loaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_stored: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    load_seconds: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS_S) + 1))  # histogram counts
    load_seconds_sum: float = 0.0
    load_failures: int = 0  # a continuation page that failed its check: the rest is recomputed
    pages_prefetched: int = 0  # disk pages a queued request's prefetch copied into L2
    prefetch_hits: int = 0  # of those, pages admission then loaded from L2


@dataclass(frozen=True)
class Continuation:
    """Tokens ``[start, start + num_tokens)`` of a key, held in lower tiers as whole pages."""

    start: int
    first: int  # offset of ``start`` inside the first page
    pages: tuple[Any, ...]  # fetched and verified, one per tier page
    tiers: tuple[TierName, ...]
    num_tokens: int


class TierIndex:
    def __init__(
        self,
        mover: PageMover,
        page_tokens: int,
        host: HostArena | None,
        disk: DiskPageStore | None,
        write_policy: WritePolicy = "write_back",
        clock: Callable[[], float] = time.perf_counter,
        prefetch: bool = True,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.mover = mover
        self.page_tokens = page_tokens
        self.host = host
        self.disk = disk if disk is not None and disk.enabled else None
        self.write_policy = write_policy
        self.clock = clock
        self.stats = TierStats()
        self.events: KVEventLog | None = None  # the cache's log: copies down are announced with their medium
        self.lock = threading.RLock()  # the host arena and ``_prefetched``: the prefetch thread shares them
        self._prefetched: set[bytes] = set()  # L2 pages a prefetch brought in and no admission used yet
        self.prefetcher = Prefetcher(self.prefetch) if prefetch and host is not None and self.disk is not None else None

    # ---- hashing ----------------------------------------------------------------------------

    def hashes(self, key: RadixKey, length: int) -> list[bytes]:
        """Chained hashes of the whole tier pages of ``key[:length]``."""
        shared = key.shared_len - key.shared_len % self.page_tokens  # a mixed page is private
        return list(page_hashes(key.token_ids[:length], key.extra_key, self.page_tokens, shared_len=shared))

    def holds(self, page_hash: bytes) -> TierName | None:
        with self.lock:
            if self.host is not None and page_hash in self.host:
                return "host"
        if self.disk is not None and page_hash in self.disk:
            return "disk"
        return None

    # ---- storing ----------------------------------------------------------------------------

    def on_insert(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """The tree just cached ``key[start:]`` at ``slots[start:]``: write-through copies it down."""
        if self.write_policy == "write_through":
            self._store(key, slots, start, host=True, disk=True)

    def on_evict(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """L1 is about to free ``key[start:]`` (``slots``: the whole path's): keep its pages below.

        Into L2 even when the disk has a copy: a page that came back from disk and
        was evicted again is hot, and L2 is the faster tier.
        """
        self._store(key, slots, start, host=True, disk=self.host is None)

    def flush_path(self, key: RadixKey, slots: IndexArray) -> None:
        """Shutdown: make sure every whole page of a cached path is on disk (or queued)."""
        self._store(key, slots, 0, host=False, disk=True)

    def flush_host(self) -> None:
        """Shutdown: queue every L2 page the disk lacks."""
        if self.disk is None or self.host is None:
            return
        with self.lock:
            for page_hash in self.host.hashes():
                page = self.host.get(page_hash)
                if page is not None and page_hash not in self.disk:
                    self._to_disk(page_hash, page)

    def clear_host(self) -> None:
        """Drop L2 (``/flush_cache``). A prefetch still running may add pages back: they are valid."""
        with self.lock:
            if self.host is not None:
                self.host.clear()
            self._prefetched.clear()

    def _store(self, key: RadixKey, slots: IndexArray, start: int, host: bool, disk: bool) -> None:
        """Copy the whole tier pages of ``key[start:]`` into the tiers asked for that lack them."""
        with self.lock:
            self._store_locked(key, slots, start, host, disk)

    def _store_locked(self, key: RadixKey, slots: IndexArray, start: int, host: bool, disk: bool) -> None:
        size, disk_store = self.page_tokens, self.disk if disk else None
        host_store = self.host if host else None
        hashes = self.hashes(key, len(slots))
        todo = []  # (page index, to host, to disk)
        for index in range(start // size, len(hashes)):
            to_host = host_store is not None and hashes[index] not in host_store
            to_disk = disk_store is not None and hashes[index] not in disk_store
            if to_host or to_disk:
                todo.append((index, to_host, to_disk))
        if not todo:
            return
        rows = np.concatenate([slots[index * size : (index + 1) * size] for index, _, _ in todo])
        pages = self.mover.split_pages(self.mover.gather(rows))  # one copy per layer for all of them
        for (index, to_host, to_disk), page in zip(todo, pages):
            if to_host:
                self._to_host(hashes[index], page)
            if to_disk:
                self._to_disk(hashes[index], page)
            if self.events is not None:
                shared = key.shared_len - key.shared_len % size  # as ``hashes`` counts it
                page_key = RadixKey(key.token_ids[: (index + 1) * size], key.extra_key, shared)
                for medium in ("cpu",) * to_host + ("disk",) * to_disk:
                    self.events.record("store", index * size, page_key, medium)

    def _to_host(self, page_hash: bytes, page: Any) -> None:
        assert self.host is not None
        self.stats.bytes_stored["host"] += int(page.numel() * page.element_size())
        for old_hash, old_page in self.host.put(page_hash, page):
            self._prefetched.discard(old_hash)
            if self.disk is not None and old_hash not in self.disk:
                self._to_disk(old_hash, old_page)

    def _to_disk(self, page_hash: bytes, page: Any) -> None:
        assert self.disk is not None
        data = self.mover.to_bytes(page)
        if self.disk.put(page_hash, data):
            self.stats.bytes_stored["disk"] += len(data)

    # ---- loading ----------------------------------------------------------------------------

    def match_continuation(self, key: RadixKey, start: int) -> Continuation:
        """Pages after ``key[:start]`` (the L1 match) held below, fetched and verified.

        Stops at the first page no tier holds or whose disk copy fails its check.
        Mutates only the tiers' recency (and drops a corrupt disk page).
        """
        size, began = self.page_tokens, self.clock()
        first_page = start // size
        pages: list[Any] = []
        tiers: list[TierName] = []
        for page_hash in self.hashes(key, len(key))[first_page:]:
            page, tier = self._fetch(page_hash)
            if page is None or tier is None:
                break
            pages.append(page)
            tiers.append(tier)
        num_tokens = max(0, (first_page + len(pages)) * size - start)
        if pages:
            self._observe_latency(self.clock() - began)
        return Continuation(start, start - first_page * size, tuple(pages), tuple(tiers), num_tokens)

    def load(self, cont: Continuation, slots: IndexArray) -> None:
        """Copy the continuation into ``slots`` (one per token) of the pool, in one copy per layer."""
        self.mover.scatter_pages(slots, cont.pages, cont.first)
        for i, (page, tier) in enumerate(zip(cont.pages, cont.tiers)):
            self.stats.hit_tokens[tier] += self.page_tokens - (cont.first if i == 0 else 0)
            self.stats.bytes_loaded[tier] += int(page.numel() * page.element_size())

    def _fetch(self, page_hash: bytes) -> tuple[Any, TierName | None]:
        with self.lock:
            page = self.host.get(page_hash) if self.host is not None else None
            if page is not None:
                if page_hash in self._prefetched:
                    self._prefetched.discard(page_hash)
                    self.stats.prefetch_hits += 1
                return page, "host"
        return self._read_disk(page_hash)

    def _read_disk(self, page_hash: bytes) -> tuple[Any, TierName | None]:
        if self.disk is None or page_hash not in self.disk:
            return None, None
        data = self.disk.get(page_hash)
        try:
            if data is not None:
                return self.mover.from_bytes(data), "disk"
        except ValueError:  # a verified page of the wrong size: the fingerprint should have caught it
            pass
        with self.lock:  # two threads read the disk
            self.stats.load_failures += 1
        return None, None

    # ---- prefetch ---------------------------------------------------------------------------

    def submit_prefetch(self, token: Any, key: RadixKey, start: int) -> None:
        """A request (``token``) was queued; ``key[:start]`` is in L1: prefetch the rest's disk pages."""
        if self.prefetcher is not None and len(key) - start >= self.page_tokens:
            self.prefetcher.submit(token, key, start)

    def cancel_prefetch(self, token: Any) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel(token)

    def prefetch(self, key: RadixKey, start: int) -> int:
        """Copy the pages after ``key[:start]`` that only the disk holds into L2 (the prefetch thread).

        Stops where no tier holds a page, at a page failing its check, or once
        the pages brought in would fill half of L2 (more would evict this
        request's own first pages). Returns the pages brought in.
        """
        assert self.host is not None
        budget, brought = self.host.capacity_bytes // 2, 0
        for page_hash in self.hashes(key, len(key))[start // self.page_tokens :]:
            with self.lock:
                if page_hash in self.host:
                    continue
            page, tier = self._read_disk(page_hash)
            if page is None or tier is None:
                break
            budget -= int(page.numel() * page.element_size())
            if budget < 0:
                break
            with self.lock:
                self._to_host(page_hash, page)
                if page_hash in self.host:
                    self._prefetched.add(page_hash)
                    self.stats.pages_prefetched += 1
                    brought += 1
        return brought

    def _observe_latency(self, seconds: float) -> None:
        bucket = int(np.searchsorted(LOAD_BUCKETS_S, seconds))
        self.stats.load_seconds[bucket] += 1
        self.stats.load_seconds_sum += seconds

    # ---- state ------------------------------------------------------------------------------

    def page_states(self, page_hash: bytes) -> tuple[bool, str]:
        """(in L2, L3 state: absent | queued | on_disk) of one page."""
        with self.lock:
            in_host = self.host is not None and page_hash in self.host
        if self.disk is None:
            return in_host, "absent"
        return in_host, self.disk.state(page_hash)

    def sizes(self) -> dict[str, Any]:
        """Tier sizes for /cache and /server_info."""
        out: dict[str, Any] = {"page_tokens": self.page_tokens, "write_policy": self.write_policy}
        if self.host is not None:
            out["host"] = {
                "pages": len(self.host),
                "used_bytes": self.host.used_bytes,
                "capacity_bytes": self.host.capacity_bytes,
                "compressed": self.host.compress,
            }
        if self.disk is not None:
            out["disk"] = {
                "pages": len(self.disk),
                "used_bytes": self.disk.used_bytes,
                "capacity_bytes": self.disk.capacity_bytes,
                "writable": self.disk.writable,
                **vars(self.disk.stats),
            }
        return out

    def close(self, timeout: float) -> bool:
        """Flush queued disk writes (up to ``timeout`` s) and release the directory; True if all landed."""
        if self.prefetcher is not None:
            self.prefetcher.close(min(timeout, 5.0))
            self.prefetcher = None
        if self.disk is None:
            return True
        done = self.disk.flush(timeout)
        self.disk.close(0.0 if not done else 1.0)
        return done
