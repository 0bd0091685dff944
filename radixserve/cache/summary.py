"""What is cached, as plain data: sizes, shape, and the prefixes most shared.

``summarize(cache)`` serves the server's ``/cache`` endpoint and the benchmarks.
Call it from the thread that owns the cache (it walks the tree). Token ids only:
the caller decodes them if it wants text. A namespace (``extra_key``, a tenant's
salt) is shown as a short hash, never as the value itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from radixserve.cache.baselines.block import BlockHashCache
from radixserve.cache.core.base import BasePrefixCache
from radixserve.cache.core.radix import RadixCache, TreeNode

HEAD_TOKENS, TAIL_TOKENS = 48, 16  # how much of each shared prefix a summary shows


def namespace_id(extra_key: str | None) -> str | None:
    """A short, stable, non-reversible name for a cache namespace (None: the shared one)."""
    if extra_key is None:
        return None
    return hashlib.blake2b(extra_key.encode(), digest_size=6, person=b"rs-ns-id").hexdigest()


def summarize(
    cache: BasePrefixCache, top_k: int = 10, visible: Callable[[str | None], bool] | None = None
) -> dict[str, Any]:
    """Sizes and shape; with ``visible``, only the namespaces it accepts (a tenant's view: no pool-wide figure)."""
    if visible is not None:
        return _namespace_view(cache, top_k, visible)
    allocator = cache.allocator
    out: dict[str, Any] = {
        "kind": {RadixCache: "radix", BlockHashCache: "block"}.get(type(cache), "none"),
        "page_size": cache.page_size,
        "pool_tokens": allocator.size,
        "free_tokens": allocator.free_size(),
        "cached_tokens": cache.total_size(),
        "evictable_tokens": cache.evictable_size(),
        "protected_tokens": cache.protected_size(),
        "evicted_tokens_total": cache.evicted_tokens,
    }
    if isinstance(cache, RadixCache):
        out.update(_radix_shape(cache, top_k))
    elif isinstance(cache, BlockHashCache):
        out.update(
            block_size=cache.block_size,
            blocks=len(cache.blocks()),
            unreachable_tokens=cache.unreachable_size(),
        )
    return out


def _namespace_view(cache: BasePrefixCache, top_k: int, visible: Callable[[str | None], bool]) -> dict[str, Any]:
    kind = {RadixCache: "radix", BlockHashCache: "block"}.get(type(cache), "none")
    out: dict[str, Any] = {"kind": kind, "page_size": cache.page_size, "namespace_view": True}
    if isinstance(cache, RadixCache):
        shape = _radix_shape(cache, top_k, visible)
        tokens = sum(len(node.key) for node in cache.nodes() if visible(node.key.extra_key))
        out.update(
            cached_tokens=tokens, **{k: shape[k] for k in ("nodes", "leaves", "namespaces", "top_shared_prefixes")}
        )
    elif isinstance(cache, BlockHashCache):
        blocks = [b for b in cache.blocks() if visible(b.extra_key)]
        out.update(blocks=len(blocks), cached_tokens=len(blocks) * cache.block_size)
    else:
        out.update(cached_tokens=0)
    return out


def _radix_shape(cache: RadixCache, top_k: int, visible: Callable[[str | None], bool] | None = None) -> dict[str, Any]:
    """Node counts, depth, namespaces, and the top shared prefixes.

    A shared prefix is a branch point (two or more children: sequences diverge
    after it) or a node at least two finished requests went through
    (``hit_count >= 2``; a request's own prompt counts once, as it is cached
    while it runs). Ranked by reuse, then by length: the system prompts and
    few-shot blocks come first.
    """
    depth: dict[int, int] = {cache.root.id: 0}
    nodes = leaves = max_depth = 0
    namespaces: set[str | None] = set()
    shared: list[tuple[int, int, TreeNode]] = []
    for node in cache.nodes():
        assert node.parent is not None
        depth[node.id] = depth[node.parent.id] + len(node.key)
        if visible is not None and not visible(node.key.extra_key):
            continue
        nodes += 1
        leaves += not node.children
        max_depth = max(max_depth, depth[node.id])
        namespaces.add(node.key.extra_key)
        if len(node.children) >= 2 or node.hit_count >= 2:
            shared.append((node.hit_count, depth[node.id], node))
    shared.sort(key=lambda item: (item[0], item[1]), reverse=True)
    top = []
    for hits, length, node in shared[:top_k]:
        tokens = cache.path_key(node).token_ids
        top.append(
            {
                "tokens": length,
                "hit_count": hits,
                "children": len(node.children),
                "lock_ref": node.lock_ref,
                "namespace": namespace_id(node.key.extra_key),
                "head_token_ids": tokens[:HEAD_TOKENS].tolist(),
                "tail_token_ids": tokens[max(HEAD_TOKENS, length - TAIL_TOKENS) :].tolist(),
            }
        )
    return {
        "eviction_policy": cache.eviction_policy,
        "nodes": nodes,
        "leaves": leaves,
        "max_depth_tokens": max_depth,
        "namespaces": len(namespaces),
        "top_shared_prefixes": top,
    }
