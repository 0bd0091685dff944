"""The prefix cache: radix tree (default), hash-block baseline, and the no-cache control.

from radixserve.cache import create_prefix_cache
from radixserve.memory import TokenAllocator

cache = create_prefix_cache("radix", TokenAllocator(4096))
"""

from __future__ import annotations

from radixserve.cache.base import BasePrefixCache, CacheReq, MatchResult
from radixserve.cache.block import BlockHashCache
from radixserve.cache.chunk import ChunkCache
from radixserve.cache.events import KVEvent, KVEventLog
from radixserve.cache.key import RadixKey
from radixserve.cache.policy import EVICTION_POLICIES, create_eviction_strategy
from radixserve.cache.radix import Clock, RadixCache, TreeNode
from radixserve.memory.allocator import TokenAllocator

PREFIX_CACHES = ("radix", "block", "none")


def create_prefix_cache(
    kind: str,
    allocator: TokenAllocator,
    page_size: int = 1,
    eviction_policy: str = "lru",
    clock: Clock | None = None,
    enable_kv_events: bool = False,
) -> BasePrefixCache:
    """The cache variant named by ``--prefix-cache`` (``radix``, ``block`` or ``none``).

    For ``block``, ``page_size`` is the block size (16 when given as 1, vLLM's default).
    """
    if kind == "radix":
        return RadixCache(allocator, page_size, eviction_policy, clock, enable_kv_events)
    if kind == "block":
        return BlockHashCache(allocator, page_size if page_size > 1 else 16, clock, enable_kv_events)
    if kind == "none":
        return ChunkCache(allocator, page_size)
    raise ValueError(f"unknown prefix cache {kind!r}; choose from {PREFIX_CACHES}")


__all__ = [
    "EVICTION_POLICIES",
    "PREFIX_CACHES",
    "BasePrefixCache",
    "BlockHashCache",
    "CacheReq",
    "ChunkCache",
    "KVEvent",
    "KVEventLog",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "TreeNode",
    "create_eviction_strategy",
    "create_prefix_cache",
]
