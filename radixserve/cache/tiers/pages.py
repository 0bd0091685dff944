"""Tier pages: what the lower cache tiers (L2 host, L3 disk) hold, how a page is named, and where it is.

Tier pages are ``page_tokens`` long (a multiple of the cache's page, at least
16 tokens: one file per token would be absurd). Their hash is the KV events'
chained page hash, namespace folded in, with the shared head counted only in
whole tier pages: a page that mixes a public head and private tokens is
private, so no tier ever answers one tenant with another's page.

Per tier and page, one state: L1 cached or not; L2 present or not; L3 absent,
queued (bytes held by the writer) or on disk. See ``page_states``.

KV events (with ``events`` set): every page a tier gains or loses is announced
with its medium (events.py), at the log's next drain. A page stored into L2
keeps its ``PageLabel`` (parent hash, tokens) beside it, so the page can still be
announced in full when L2 spills it to L3, and L3 keeps it in the page file's
header (labels.py), events on or not. The pages the disk already holds when
the tiers are built (a warm restart's) are announced at the first drain, in full,
from those headers (by hash alone for a version 1 file, which has no label).

``TierPages`` is the state the store flow (store.py) and the load-back
(index.py) share: the stores, the lock, the counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from radixserve.cache.core.key import RadixKey, page_hashes
from radixserve.cache.events import KVEventLog, PageLabel
from radixserve.cache.tiers.events import Medium, TierAnnouncer
from radixserve.cache.tiers.labels import decode_label
from radixserve.memory.allocator import IndexArray

if TYPE_CHECKING:  # torch stays out of the cache layer's imports
    from radixserve.cache.tiers.disk_store import DiskStats
    from radixserve.cache.tiers.host_arena import HostArena

WRITE_POLICIES = ("write_back", "write_through")
WritePolicy = Literal["write_back", "write_through"]
TierName = Literal["host", "disk"]
LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class PageMover(Protocol):
    """Copies between the KV pool and opaque tier pages (kv_pages.py over a KVPool)."""

    def gather(self, slots: IndexArray) -> Any: ...
    def split_pages(self, rows: Any) -> Sequence[Any]: ...
    def scatter_pages(self, slots: IndexArray, pages: Sequence[Any], first: int) -> None: ...
    def to_bytes(self, page: Any) -> bytes: ...
    def from_bytes(self, data: bytes) -> Any: ...


class PageStore(Protocol):
    """The disk tier (L3): pages by hash, each stored with its label's bytes (disk_store.py's
    ``DiskPageStore``; the benchmarks' tier_sim.py keeps one in memory for simulations)."""

    enabled: bool  # usable at all (opened, fingerprint matched)
    writable: bool
    capacity_bytes: int
    stats: DiskStats
    on_drop: Callable[[bytes], None] | None  # set by ``TierPages``: called with a page's hash once it is gone

    @property
    def used_bytes(self) -> int: ...
    def __contains__(self, page_hash: bytes) -> bool: ...
    def __len__(self) -> int: ...
    def put(self, page_hash: bytes, payload: bytes, label: bytes = b"") -> bool: ...
    def get(self, page_hash: bytes) -> bytes | None: ...
    def labels(self) -> list[tuple[bytes, bytes]]: ...
    def drop_corrupt(self, page_hash: bytes) -> None: ...
    def state(self, page_hash: bytes) -> str: ...
    def clear(self) -> int: ...
    def flush(self, timeout: float) -> bool: ...
    def close(self, timeout: float = ...) -> None: ...


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
    host_evicted_pages: int = 0  # L2 pages evicted (least recently used) to make room


class TierPages:
    def __init__(
        self,
        mover: PageMover,
        page_tokens: int,
        host: HostArena | None,
        disk: PageStore | None,
        write_policy: WritePolicy = "write_back",
        clock: Callable[[], float] = time.perf_counter,
        events: KVEventLog | None = None,
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
        self.lock = threading.RLock()  # the host arena and ``_prefetched``: the prefetch thread shares them
        self._prefetched: set[bytes] = set()  # L2 pages a prefetch brought in and no admission used yet
        self._labels: dict[bytes, PageLabel] = {}  # L2 pages' labels (under ``lock``), with events or a disk tier
        if self.disk is not None:
            self.disk.on_drop = self._dropped_from_disk
        # ``events``: the cache's log; what each tier gains and loses is announced there with its medium.
        self._events = events
        self._announcer = TierAnnouncer(events, page_tokens, self._holds) if events is not None else None
        if self._announcer is not None and self.disk is not None:
            self._announcer.restored(self._disk_labels(), "disk")  # a router learns a restarted engine's disk

    @property
    def events(self) -> KVEventLog | None:
        """The log each tier's gains and losses are announced in, given at construction (None: no events)."""
        return self._events

    def _disk_labels(self) -> list[tuple[bytes, PageLabel | None]]:
        """The disk's pages and their labels, read from the files' headers (None: a version 1 file's page). A page
        whose label is not its own (it does not hash to the page's name) is dropped as corrupt, never announced."""
        assert self.disk is not None
        pages = []
        for page_hash, data in self.disk.labels():
            label = decode_label(data, page_hash, self.page_tokens) if data else None
            if data and label is None:
                self.disk.drop_corrupt(page_hash)
            else:
                pages.append((page_hash, label))
        return pages

    def _stored(self, page_hash: bytes, medium: Medium, label: PageLabel | None) -> None:
        """A tier took a page (any thread): announce it at the next drain."""
        if self._announcer is not None and label is not None:
            self._announcer.stored(page_hash, medium, label)

    def _dropped(self, page_hash: bytes, medium: Medium) -> None:
        """A tier dropped a page (any thread): announce it at the next drain."""
        if self._announcer is not None:
            self._announcer.dropped(page_hash, medium)

    def _dropped_from_disk(self, page_hash: bytes) -> None:
        self._dropped(page_hash, "disk")

    def _holds(self, page_hash: bytes, medium: Medium) -> bool:
        in_host, on_disk = self.page_states(page_hash)
        return in_host if medium == "cpu" else on_disk != "absent"

    def hashes(self, key: RadixKey, length: int) -> list[bytes]:
        """Chained hashes of the whole tier pages of ``key[:length]``."""
        shared = key.shared_len - key.shared_len % self.page_tokens  # a mixed page is private
        return list(page_hashes(key.token_ids[:length], key.extra_key, self.page_tokens, shared_len=shared))

    def label(self, key: RadixKey, hashes: Sequence[bytes], index: int) -> PageLabel | None:
        """The label of tier page ``index`` of ``key`` (``hashes``: its pages'); None with neither events nor a disk
        tier (the two that keep it)."""
        if self._events is None and self.disk is None:
            return None
        size = self.page_tokens
        shared = key.shared_len - key.shared_len % size if key.extra_key is not None else 0  # as ``hashes``
        tokens = key.token_ids[index * size : (index + 1) * size].copy()
        return PageLabel(hashes[index - 1] if index else None, tokens, key.extra_key, min(shared, (index + 1) * size))

    def holds(self, page_hash: bytes) -> TierName | None:
        with self.lock:
            if self.host is not None and page_hash in self.host:
                return "host"
        if self.disk is not None and page_hash in self.disk:
            return "disk"
        return None

    def page_states(self, page_hash: bytes) -> tuple[bool, str]:
        """(in L2, L3 state: absent | queued | on_disk) of one page."""
        with self.lock:
            in_host = self.host is not None and page_hash in self.host
        if self.disk is None:
            return in_host, "absent"
        return in_host, self.disk.state(page_hash)
