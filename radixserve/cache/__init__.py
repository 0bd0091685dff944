"""The prefix cache: radix tree (default), hash-block baseline, and the no-cache control.

from radixserve.cache import create_prefix_cache
from radixserve.memory import TokenAllocator

cache = create_prefix_cache("radix", TokenAllocator(4096))
"""

from __future__ import annotations

from radixserve.cache.baselines.block import BlockHashCache
from radixserve.cache.baselines.chunk import ChunkCache
from radixserve.cache.core.base import BasePrefixCache, CacheReq, MatchResult
from radixserve.cache.core.key import RadixKey
from radixserve.cache.core.policy import EVICTION_POLICIES, create_eviction_strategy
from radixserve.cache.core.radix import Clock, RadixCache, TreeNode
from radixserve.cache.events import KVEvent, KVEventLog, PageLabel
from radixserve.cache.tiers.pages import WRITE_POLICIES
from radixserve.memory.allocator import TokenAllocator

PREFIX_CACHES = ("radix", "block", "none")


def create_prefix_cache(
    kind: str,
    allocator: TokenAllocator | int,
    page_size: int = 1,
    eviction_policy: str = "lru",
    clock: Clock | None = None,
    enable_kv_events: bool = False,
) -> BasePrefixCache:
    """The cache variant named by ``--prefix-cache`` (``radix``, ``block`` or ``none``).

    For ``block``, ``page_size`` is the block size (16 when given as 1, vLLM's default).
    ``allocator`` may be a pool size in tokens: then the allocator is built here,
    with the page this variant needs (see ``pool_allocator``).
    """
    if not isinstance(allocator, TokenAllocator):
        allocator = pool_allocator(kind, allocator, page_size)
    if kind == "radix":
        return RadixCache(allocator, page_size, eviction_policy, clock, enable_kv_events)
    if kind == "block":
        return BlockHashCache(allocator, page_size if page_size > 1 else 16, clock, enable_kv_events)
    if kind == "none":
        return ChunkCache(allocator, page_size)
    raise ValueError(f"unknown prefix cache {kind!r}; choose from {PREFIX_CACHES}")


def pool_allocator(kind: str, pool_tokens: int, page_size: int) -> TokenAllocator:
    """The slot allocator under a ``kind`` cache of about ``pool_tokens`` tokens.

    Only the radix tree allocates whole pages; the block cache keys 16-token
    blocks over single slots, and the no-cache control reuses nothing. The pool
    is rounded down to a multiple of max(page, 16) tokens.
    """
    page = page_size if kind == "radix" else 1
    size = pool_tokens - pool_tokens % max(page, 16)
    return TokenAllocator(size, page)


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
    "PageLabel",
    "RadixCache",
    "RadixKey",
    "TreeNode",
    "WRITE_POLICIES",
    "create_eviction_strategy",
    "create_prefix_cache",
    "pool_allocator",
]
