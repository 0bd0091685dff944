"""The radix tree's hottest subtrees as a small nested tree of plain data (the dashboard's icicle).

``hot_subtrees(cache, max_nodes)`` walks the tree once for each subtree's size, then keeps the
``max_nodes`` hottest nodes best first from the root (most hits, then most tokens): a parent
is always considered before its children, so what it keeps hangs together. Each kept node says
its edge (``tokens``, the first ``HEAD_TOKENS`` as ids: the caller decodes them if the viewer
may read them), its subtree's size, hits and age. With ``visible``, only the namespaces it
accepts are kept; a kept node hangs under its nearest kept ancestor. Call it from the thread
that owns the cache; it reads only (no split, no access-time update). O(n log n) in nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from radixserve.cache.core.base import BasePrefixCache
from radixserve.cache.core.radix import RadixCache, TreeNode
from radixserve.cache.summary import HEAD_TOKENS, namespace_id


def hot_subtrees(
    cache: BasePrefixCache, max_nodes: int = 120, visible: Callable[[str | None], bool] | None = None
) -> dict[str, Any] | None:
    """The root with its hottest descendants (None: the cache is not a radix tree)."""
    if not isinstance(cache, RadixCache):
        return None
    sizes = subtree_sizes(cache)
    now = cache.clock()
    root: dict[str, Any] = {"id": cache.root.id, "tokens": 0, "subtree_tokens": 0, "children": []}
    kept: dict[int, dict[str, Any]] = {cache.root.id: root}
    heap: list[tuple[int, int, int, TreeNode]] = []

    def push_children(node: TreeNode) -> None:
        for child in node.children.values():
            heapq.heappush(heap, (-child.hit_count, -sizes[child.id], child.id, child))

    push_children(cache.root)
    while heap and len(kept) <= max_nodes:
        node = heapq.heappop(heap)[3]
        push_children(node)
        if visible is not None and not visible(node.key.extra_key):
            continue
        entry = _entry(node, sizes[node.id], now)
        kept[node.id] = entry
        _kept_ancestor(node, kept)["children"].append(entry)
    root["subtree_tokens"] = sum(child["subtree_tokens"] for child in root["children"])
    return {"nodes": len(sizes), "shown": len(kept) - 1, "root": root}


def subtree_sizes(cache: RadixCache) -> dict[int, int]:
    """Tokens in each node's subtree (its edge included), by node id."""
    order = list(cache.nodes())  # parents before children
    sizes: dict[int, int] = {}
    for node in reversed(order):
        sizes[node.id] = len(node.key) + sum(sizes[child.id] for child in node.children.values())
    return sizes


def _entry(node: TreeNode, subtree_tokens: int, now: float) -> dict[str, Any]:
    return {
        "id": node.id,
        "tokens": len(node.key),
        "depth_tokens": node.depth,
        "subtree_tokens": subtree_tokens,
        "hit_count": node.hit_count,
        "age_s": round(max(now - node.last_access_time, 0.0), 3),
        "lock_ref": node.lock_ref,
        "namespace": namespace_id(node.key.extra_key),
        "head_token_ids": node.key.token_ids[:HEAD_TOKENS].tolist(),
        "children": [],
    }


def _kept_ancestor(node: TreeNode, kept: dict[int, dict[str, Any]]) -> dict[str, Any]:
    cursor = node.parent
    while cursor is not None and cursor.id not in kept:
        cursor = cursor.parent
    assert cursor is not None, "the root is always kept"
    return kept[cursor.id]
