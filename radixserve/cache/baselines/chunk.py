"""ChunkCache: the control (``--prefix-cache none``). Same interface, keeps nothing.

Every match is empty and every finished request frees all of its slots, so a
run with it shows what the prefix cache saves: the hit rate is flat zero by
construction, which is also the tell when the cache was disabled by accident.
"""

from __future__ import annotations

from radixserve.cache.core.base import EMPTY_INDICES, BasePrefixCache, CacheReq, MatchResult
from radixserve.cache.core.key import RadixKey
from radixserve.memory.allocator import IndexArray, TokenAllocator


class ChunkCache(BasePrefixCache[None]):
    def __init__(self, allocator: TokenAllocator, page_size: int = 1) -> None:
        super().__init__(allocator, page_size)  # it stores nothing: no listener has anything to hear

    def _clear(self) -> None:
        pass

    def match_prefix(self, key: RadixKey) -> MatchResult[None]:
        return MatchResult(EMPTY_INDICES, None)

    def insert(self, key: RadixKey, indices: IndexArray, priority: int = 0, count_hit: bool = True) -> int:
        raise NotImplementedError("ChunkCache keeps nothing: release slots with cache_finished_req")

    def cache_finished_req(self, req: CacheReq[None], is_insert: bool = True) -> None:
        """Free every slot of the request (it never shared any)."""
        self.allocator.free(req.kv_indices[req.cache_protected_len :])
        req.kv_indices, req.last_node, req.cache_protected_len = EMPTY_INDICES, None, 0

    def cache_unfinished_req(self, req: CacheReq[None]) -> None:
        """Nothing to share: the request keeps its private slots."""

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: None) -> int:
        return 0

    def dec_lock_ref(self, node: None) -> int:
        return 0

    def cached_slots(self) -> IndexArray:
        return EMPTY_INDICES

    def check_invariants(self) -> None:
        assert self.evictable_size() == self.protected_size() == 0
