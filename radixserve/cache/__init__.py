"""The prefix cache: the radix tree (default), its baselines, the adaptive policy, the tiers below the pool.

    core/        the contract every variant answers, keys, the tree, its eviction candidates and policies,
                 and the listener interface (what a cache tells the parts attached to it)
    baselines/   the hash-block cache (vLLM-style) and the no-cache control
    adaptive/    the adaptive eviction policy
    tiers/       host memory (L2) and a disk directory (L3) below the KV pool
    events.py    the KV event log, a listener      summary.py   what is cached, as plain data (``/cache``)

This module is the registry (``create_prefix_cache``, ``PREFIX_CACHES``) and the names other layers use::

    from radixserve.cache import KVEventLog, create_prefix_cache
    from radixserve.memory import TokenAllocator

    events = KVEventLog(page_size=1)
    cache = create_prefix_cache("radix", TokenAllocator(4096), listeners=[events])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixserve.cache.baselines.block import BlockHashCache
from radixserve.cache.baselines.chunk import ChunkCache
from radixserve.cache.core.base import BasePrefixCache, CacheReq, MatchResult, TierLoad
from radixserve.cache.core.key import RadixKey
from radixserve.cache.core.listener import CacheListener
from radixserve.cache.core.policy import EVICTION_POLICIES, create_eviction_strategy
from radixserve.cache.core.radix import Clock, RadixCache, TreeNode
from radixserve.cache.events import KVEvent, KVEventLog, PageLabel
from radixserve.cache.tiers.pages import WRITE_POLICIES
from radixserve.memory.allocator import TokenAllocator

if TYPE_CHECKING:
    from radixserve.cache.tiers.index import TierIndex

PREFIX_CACHES = ("radix", "block", "none")


def create_prefix_cache(
    kind: str,
    allocator: TokenAllocator | int,
    page_size: int = 1,
    eviction_policy: str = "lru",
    clock: Clock | None = None,
    listeners: Sequence[CacheListener] = (),
    tiers: TierIndex | None = None,
) -> BasePrefixCache:
    """The cache variant named by ``--prefix-cache`` (``radix``, ``block`` or ``none``).

    For ``block``, ``page_size`` is the block size (16 when given as 1, vLLM's default: see
    ``cache_page_size``). ``allocator`` may be a pool size in tokens: then the allocator is built
    here, with the page this variant needs (see ``pool_allocator``). ``listeners`` (a ``KVEventLog``)
    hear every insert, eviction and reset; the no-cache control stores nothing, so none are attached
    to it. ``tiers`` (radix only): L2 / L3 below the pool (``tiers.build.build_tiers``).
    """
    if not isinstance(allocator, TokenAllocator):
        allocator = pool_allocator(kind, allocator, page_size)
    if tiers is not None and kind != "radix":
        raise ValueError(f"cache tiers need the radix prefix cache, not {kind!r}")
    if kind == "radix":
        return RadixCache(allocator, page_size, eviction_policy, clock, listeners, tiers)
    if kind == "block":
        return BlockHashCache(allocator, cache_page_size(kind, page_size), clock, listeners)
    if kind == "none":
        return ChunkCache(allocator, page_size)
    raise ValueError(f"unknown prefix cache {kind!r}; choose from {PREFIX_CACHES}")


def cache_page_size(kind: str, page_size: int) -> int:
    """The page a ``kind`` cache keys (a ``KVEventLog`` for it must use the same): the block cache's
    block is 16 tokens when ``page_size`` is 1."""
    return 16 if kind == "block" and page_size == 1 else page_size


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
    "CacheListener",
    "CacheReq",
    "ChunkCache",
    "KVEvent",
    "KVEventLog",
    "MatchResult",
    "PageLabel",
    "RadixCache",
    "RadixKey",
    "TierLoad",
    "TreeNode",
    "WRITE_POLICIES",
    "cache_page_size",
    "create_eviction_strategy",
    "create_prefix_cache",
    "pool_allocator",
]
