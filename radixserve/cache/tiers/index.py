"""The tier index: where a cached page lives below the KV pool (L2 host, L3 disk), and loading it back.

The tree holds L1 only (slot indices). Pages it evicts are kept below it
(store.py); ``match_continuation`` finds, after the part of a key the
tree matched, the run of pages still held in L2 or L3, so admission copies
them back into fresh slots instead of recomputing them. What a tier page is,
and how it is named: pages.py.

Prefetch (with both L2 and L3): a request entering the waiting queue has its
disk-only continuation read into L2 by a thread (prefetch.py), so
admission copies from host memory. ``lock`` guards the host arena and the
prefetch bookkeeping; the disk store locks itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from radixserve.cache.core.key import RadixKey
from radixserve.cache.events import KVEventLog, PageLabel
from radixserve.cache.tiers.pages import LOAD_BUCKETS_S, PageMover, PageStore, TierName, WritePolicy
from radixserve.cache.tiers.prefetch import Prefetcher
from radixserve.cache.tiers.store import TierStore
from radixserve.memory.allocator import IndexArray

if TYPE_CHECKING:  # torch stays out of the cache layer's imports
    from radixserve.cache.tiers.host_arena import HostArena

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """Tokens ``[start, start + num_tokens)`` of a key, held in lower tiers as whole pages."""

    start: int
    first: int  # offset of ``start`` inside the first page
    pages: tuple[Any, ...]  # fetched and verified, one per tier page
    tiers: tuple[TierName, ...]
    num_tokens: int


class TierIndex(TierStore):
    def __init__(
        self,
        mover: PageMover,
        page_tokens: int,
        host: HostArena | None,
        disk: PageStore | None,
        write_policy: WritePolicy = "write_back",
        clock: Callable[[], float] = time.perf_counter,
        prefetch: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        """``events``: the log of the cache these tiers sit under (the same object in its ``listeners``)."""
        super().__init__(mover, page_tokens, host, disk, write_policy, clock, events)
        self.prefetcher = Prefetcher(self.prefetch) if prefetch and host is not None and self.disk is not None else None

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
        hashes = self.hashes(key, len(key))
        for index in range(first_page, len(hashes)):
            page, tier = self._fetch(hashes[index], self.label(key, hashes, index))
            if page is None or tier is None:
                break
            pages.append(page)
            tiers.append(tier)
        num_tokens = max(0, (first_page + len(pages)) * size - start)
        if pages:
            self._observe_latency(self.clock() - began)
        return Continuation(start, start - first_page * size, tuple(pages), tuple(tiers), num_tokens)

    def load(self, cont: Continuation, slots: IndexArray) -> dict[TierName, int]:
        """Copy the continuation into ``slots`` (one per token) of the pool, in one copy per layer;
        the tokens each tier gave."""
        self.mover.scatter_pages(slots, cont.pages, cont.first)
        loaded: dict[TierName, int] = {}
        for i, (page, tier) in enumerate(zip(cont.pages, cont.tiers)):
            num_tokens = self.page_tokens - (cont.first if i == 0 else 0)
            loaded[tier] = loaded.get(tier, 0) + num_tokens
            self.stats.hit_tokens[tier] += num_tokens
            self.stats.bytes_loaded[tier] += int(page.numel() * page.element_size())
        return loaded

    def _fetch(self, page_hash: bytes, label: PageLabel | None) -> tuple[Any, TierName | None]:
        with self.lock:
            page = self.host.get(page_hash) if self.host is not None else None
            if page is not None:
                if page_hash in self._prefetched:
                    self._prefetched.discard(page_hash)
                    self.stats.prefetch_hits += 1
                return page, "host"
        return self._read_disk(page_hash, label)

    def _read_disk(self, page_hash: bytes, label: PageLabel | None) -> tuple[Any, TierName | None]:
        """The page from L3, verified. ``label``: what it holds, announced now if it never was (a restart's page)."""
        if self.disk is None or page_hash not in self.disk:
            return None, None
        data = self.disk.get(page_hash)
        try:
            if data is not None:
                page = self.mover.from_bytes(data)
                self._stored(page_hash, "disk", label)
                return page, "disk"
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
        hashes = self.hashes(key, len(key))
        for index in range(start // self.page_tokens, len(hashes)):
            page_hash = hashes[index]
            with self.lock:
                if page_hash in self.host:
                    continue
            label = self.label(key, hashes, index)
            page, tier = self._read_disk(page_hash, label)
            if page is None or tier is None:
                break
            budget -= int(page.numel() * page.element_size())
            if budget < 0:
                break
            with self.lock:
                self._to_host(page_hash, page, label)
                if page_hash in self.host:
                    self._prefetched.add(page_hash)
                    self.stats.pages_prefetched += 1
                    brought += 1
        return brought

    def clear(self, host: bool, disk: bool) -> tuple[int, int]:
        """Drop L2 (``host``) and / or L3 (``disk``) for a flush; the (host, disk) pages dropped. A prefetch job
        still running (its request was admitted and cancelled it too late) is waited for first, up to 5 s, so
        it cannot copy a flushed disk page back into L2."""
        if self.prefetcher is not None and not self.prefetcher.wait_idle(5.0):
            logger.warning("flush: a cache prefetch is still running; it may bring pages back into the host tier")
        return self.clear_host() if host else 0, self.clear_disk() if disk else 0

    def _observe_latency(self, seconds: float) -> None:
        bucket = int(np.searchsorted(LOAD_BUCKETS_S, seconds))
        self.stats.load_seconds[bucket] += 1
        self.stats.load_seconds_sum += seconds

    # ---- state ------------------------------------------------------------------------------

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
