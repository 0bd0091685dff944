"""The prefix-cache contract every variant answers (radix, block, none).

Seven operations, as in the chapter: ``reset``, ``match_prefix``,
``cache_finished_req``, ``cache_unfinished_req``, ``evict``, ``inc_lock_ref``,
``dec_lock_ref``; plus the tree primitive ``insert`` and the size counters.

Who owns which slot of a request (``CacheReq.kv_indices``)::

    0                 cache_protected_len                         len(token_ids)
    |-- owned by the cache, --|-- private: allocated for this request, --|
    |   locked via last_node  |   freed by it or handed to the cache     |
                               \\__ the last page may be partial (page_size > 1):
                                   the request owns that whole page until it
                                   frees it; the cache only ever holds full pages.

``cache_finished_req`` hands the private part to the cache (duplicates of what
the cache already holds are freed) and unlocks; ``cache_unfinished_req`` does
the same but keeps the request running, now locked on its own longer prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple

import numpy as np
from typing_extensions import TypeVar

from radixserve.cache.core.key import RadixKey, TokenArray
from radixserve.cache.core.listener import CacheListener
from radixserve.cache.events import KVEventLog
from radixserve.memory.allocator import IndexArray, TokenAllocator

if TYPE_CHECKING:
    from radixserve.cache.tiers.index import TierIndex
    from radixserve.cache.tiers.pages import TierName

EMPTY_INDICES: IndexArray = np.empty(0, dtype=np.int64)

# What a variant locks: RadixCache's TreeNode, BlockHashCache's Block, ChunkCache's None. Callers
# that only hand a match's node back to the cache it came from (the scheduler) leave it unbound.
NodeT = TypeVar("NodeT", default=Any)


class MatchResult(NamedTuple, Generic[NodeT]):
    """Slots of the longest cached prefix, and the node to lock before using them."""

    indices: IndexArray
    last_node: NodeT


@dataclass(frozen=True)
class TierLoad:
    """What ``load_continuation`` copied back into the pool for one request, and when (the tiers' clock)."""

    num_tokens: Mapping[TierName, int]  # by tier: "host" (L2), "disk" (L3)
    began: float
    ended: float


@dataclass(eq=False)
class CacheReq(Generic[NodeT]):
    """The part of a request the cache reads and updates.

    ``kv_indices[i]`` is the KV slot of ``key.token_ids[i]``; the two grow together.
    """

    key: RadixKey  # the tokens computed so far, in the request's namespace
    kv_indices: IndexArray
    priority: int = 0
    last_node: NodeT | None = None  # locked while the request holds the cache's prefix; None once finished
    cache_protected_len: int = 0
    tier_load: TierLoad | None = None  # set when admission loaded part of it from the tiers (tracing reads it)

    @property
    def token_ids(self) -> TokenArray:
        return self.key.token_ids

    @property
    def extra_key(self) -> str | None:
        return self.key.extra_key

    @property
    def num_cached_tokens(self) -> int:
        return self.cache_protected_len


class BasePrefixCache(ABC, Generic[NodeT]):
    """Indexes KV slots by token prefix. Single-threaded: call from the scheduler only."""

    def __init__(
        self,
        allocator: TokenAllocator,
        page_size: int,
        listeners: Sequence[CacheListener] = (),
        tiers: TierIndex | None = None,
    ) -> None:
        """``listeners`` hear every insert, eviction and reset (core/listener.py); ``tiers``: L2 / L3 below
        the pool (radix only; None: the pool is the only tier), a listener too, told after the others."""
        if page_size % allocator.page_size:
            raise ValueError(f"cache page_size {page_size} must be a multiple of the allocator's {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._listeners: tuple[CacheListener, ...] = (*listeners, *((tiers,) if tiers is not None else ()))
        self._events = next((x for x in listeners if isinstance(x, KVEventLog)), None)
        if self._events is not None and self._events.page_size != page_size:
            raise ValueError(f"the KV event log's page ({self._events.page_size}) must be the cache's ({page_size})")
        self._tiers = tiers
        # Change only in lock, unlock, insert and delete (and _clear).
        self._evictable_size = 0
        self._protected_size = 0
        self.evicted_tokens = 0  # running total, for metrics

    @property
    def events(self) -> KVEventLog | None:
        """The KV event log among the listeners, which the server drains (None: events off)."""
        return self._events

    @property
    def tiers(self) -> TierIndex | None:
        """The tier index below the pool, given at construction (None: the pool is the only tier)."""
        return self._tiers

    # ---- the primitives each variant implements -------------------------------------------

    def reset(self) -> None:
        """Drop every cached prefix and free its slots. Raises if any prefix is locked."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens: finish or abort requests first")
        self.allocator.free(self.cached_slots())
        self._clear()
        for listener in self._listeners:
            listener.on_clear()

    @abstractmethod
    def _clear(self) -> None:
        """Forget every cached prefix (slots already freed) and zero the size counters."""

    @abstractmethod
    def match_prefix(self, key: RadixKey) -> MatchResult[NodeT]:
        """Longest cached prefix of ``key`` (rounded down to page_size)."""

    @abstractmethod
    def insert(self, key: RadixKey, indices: IndexArray, priority: int = 0, count_hit: bool = True) -> int:
        """Cache ``key`` -> ``indices``; return the length that was already cached.

        The cache takes ownership of ``indices[returned:]``. The caller still
        owns ``indices[:returned]`` and frees whichever of them it allocated
        itself (they duplicate slots the cache already holds). ``count_hit``:
        whether this insert counts as a reuse of the nodes it passes through
        (True for finished requests, False for a chunk of a running one).
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` cached slots if possible; return how many were freed."""

    @abstractmethod
    def inc_lock_ref(self, node: NodeT) -> int:
        """Protect ``node``'s whole prefix from eviction; return the evictable-size delta."""

    @abstractmethod
    def dec_lock_ref(self, node: NodeT) -> int:
        """Undo one ``inc_lock_ref(node)``; return the evictable-size delta."""

    def evictable_size(self) -> int:
        """Cached tokens no live request locks: what ``evict`` can still reclaim."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Cached tokens locked by live requests."""
        return self._protected_size

    @abstractmethod
    def check_invariants(self) -> None:
        """Verify every structural invariant; raise AssertionError on the first broken one."""

    @abstractmethod
    def cached_slots(self) -> IndexArray:
        """Every slot the cache owns (for conservation checks)."""

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    # ---- the request-level operations, shared by every variant that keeps KV -------------------

    def cache_finished_req(self, req: CacheReq[NodeT], is_insert: bool = True) -> None:
        """Hand a finished request's KV to the cache and unlock its prefix.

        Mutates the tree (insert may split). Afterwards the request owns no slot:
        duplicates and the partial last page are freed here. Finishing it again
        changes nothing.
        """
        protected = req.cache_protected_len
        if is_insert:
            aligned = len(req.kv_indices) - len(req.kv_indices) % self.page_size
            new_prefix_len = self.insert(req.key[:aligned], req.kv_indices[:aligned], req.priority)
            self.allocator.free(req.kv_indices[protected:new_prefix_len])
            self.allocator.free(req.kv_indices[aligned:])
        else:
            self.allocator.free(req.kv_indices[protected:])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.cache_protected_len = None, 0
        req.kv_indices = EMPTY_INDICES

    def cache_unfinished_req(self, req: CacheReq[NodeT]) -> None:
        """Cache what a running request computed so far (chunked prefill) and re-lock.

        Mutates the tree. Afterwards ``kv_indices[:cache_protected_len]`` are the
        cache's slots (the request's duplicates are freed) and the request is
        locked on its new, longer prefix; its partial last page stays private.
        """
        aligned = len(req.kv_indices) - len(req.kv_indices) % self.page_size
        key = req.key[:aligned]
        new_prefix_len = self.insert(key, req.kv_indices[:aligned], req.priority, count_hit=False)
        self.allocator.free(req.kv_indices[req.cache_protected_len : new_prefix_len])
        indices, node = self.match_prefix(key)
        if len(indices) != aligned:
            raise AssertionError(f"cache lost a locked prefix: matched {len(indices)} of {aligned}")
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.kv_indices = np.concatenate([indices, req.kv_indices[aligned:]])
        req.last_node, req.cache_protected_len = node, aligned

    def _inserted(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """Tell the listeners the cache now holds ``key[start:]`` (see core/listener.py for ``slots``)."""
        for listener in self._listeners:
            listener.on_insert(key, slots, start)

    def _evicting(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """Tell the listeners the cache is about to free ``key[start:]`` (its slots not freed yet)."""
        for listener in self._listeners:
            listener.on_evict(key, slots, start)

    # ---- helpers the scheduler, tests and benchmarks share -------------------------------------

    def open_request(self, key: RadixKey, priority: int = 0) -> CacheReq[NodeT]:
        """Match the longest cached prefix of ``key`` and lock it for a new request.

        Mutates as ``match_prefix`` does. The returned request holds only the
        cached prefix; call ``extend_request`` for the rest (the caller keeps the
        full token list; the request's key keeps ``key``'s namespaces as it grows).
        """
        indices, node = self.match_prefix(key)
        self.inc_lock_ref(node)
        req = CacheReq(key[: len(indices)], indices, priority, node, len(indices))
        if self.tiers is not None:
            self.load_continuation(req, key)
        return req

    def cached_len(self, key: RadixKey) -> int:
        """Tokens of ``key`` cached in L1, without mutating anything (as ``match_prefix`` would)."""
        return 0  # only the radix tree has tiers below it: it overrides this

    def prefetch(self, token: Hashable, key: RadixKey) -> None:
        """``key``'s request (``token``) was queued: start bringing its disk continuation into L2."""
        if self.tiers is not None:
            self.tiers.submit_prefetch(token, key, self.cached_len(key))

    def cancel_prefetch(self, token: Hashable) -> None:
        """The request left the queue (admitted, aborted): its prefetch, if not started, is skipped."""
        if self.tiers is not None:
            self.tiers.cancel_prefetch(token)

    def load_continuation(self, req: CacheReq[NodeT], key: RadixKey) -> int:
        """Copy the part of ``key`` after ``req``'s L1 match that L2 / L3 hold into new slots.

        ``req`` must be locked on its match (``open_request`` does it): the slots
        for the loaded pages may come from evicting other prefixes. The loaded
        tokens join the tree and ``req`` is re-locked on the longer prefix.
        Returns the tokens loaded (0: nothing below, or no room: it is recomputed).
        """
        assert self.tiers is not None
        began = self.tiers.clock()
        cont = self.tiers.match_continuation(key, len(req.key))
        if not cont.num_tokens:
            return 0
        slots = self.alloc_slots(cont.num_tokens)
        if slots is None:
            return 0
        loaded = self.tiers.load(cont, slots)
        req.tier_load = TierLoad(loaded, began, self.tiers.clock())
        req.key = key[: cont.start + cont.num_tokens]
        req.kv_indices = np.concatenate([req.kv_indices, slots])
        self.cache_unfinished_req(req)
        return cont.num_tokens

    def extend_request(self, req: CacheReq[NodeT], new_token_ids: Sequence[int] | TokenArray) -> bool:
        """Give ``req`` slots for ``new_token_ids`` (evicting if short). False: the pool can't.

        Fills the unused end of the request's partial last page first, so the
        request never holds two partial pages. On False nothing changed.
        """
        new = np.asarray(new_token_ids, dtype=np.int64)
        used = len(req.kv_indices) % self.allocator.page_size
        reuse = min(len(new), self.allocator.page_size - used) if used else 0
        slots = self.alloc_slots(len(new) - reuse)
        if slots is None:
            return False
        if reuse:
            last = int(req.kv_indices[-1])
            slots = np.concatenate([np.arange(last + 1, last + 1 + reuse, dtype=np.int64), slots])
        req.key = req.key.extended(new)
        req.kv_indices = np.concatenate([req.kv_indices, slots])
        return True

    def truncate_request(self, req: CacheReq[NodeT], length: int) -> None:
        """Keep ``req``'s first ``length`` tokens and free the slots of the rest (rejected draft tokens).

        Only private tokens go (``length >= cache_protected_len``); the cache does not change. With pages, the
        partial last page stays the request's (``extend_request`` fills it next).
        """
        if not req.cache_protected_len <= length <= len(req.kv_indices):
            raise ValueError(f"cannot cut a request of {len(req.kv_indices)} tokens to {length}")
        page = self.allocator.page_size
        self.allocator.free(req.kv_indices[-(-length // page) * page :])
        req.key = req.key[:length]
        req.kv_indices = req.kv_indices[:length]

    def alloc_slots(self, num_tokens: int) -> IndexArray | None:
        """Allocator slots, evicting unlocked cached prefixes when the pool is short."""
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            page = self.allocator.page_size
            self.evict(-(-num_tokens // page) * page - self.allocator.free_size())
            slots = self.allocator.alloc(num_tokens)
        return slots
