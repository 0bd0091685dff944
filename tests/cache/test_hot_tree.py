"""hot_subtrees(): the dashboard's icicle, the hottest part of the tree as nested plain data."""

from __future__ import annotations

from typing import Any

from radixserve.cache import create_prefix_cache
from radixserve.cache.hot_tree import hot_subtrees
from radixserve.cache.summary import namespace_id
from radixserve.memory import TokenAllocator
from tests.cache.helpers import serve

SYSTEM = list(range(100, 164))  # a 64-token shared prefix


def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for child in node["children"]:
        out += [child, *walk(child)]
    return out


def test_the_shared_prefix_comes_first_with_its_branches_below() -> None:
    cache = create_prefix_cache("radix", TokenAllocator(4096))
    for tail in ([1, 2, 3], [4, 5], [6, 7, 8, 9], [6, 7, 10]):
        serve(cache, SYSTEM + tail)
    serve(cache, [7] * 10, extra_key="tenant")
    out = hot_subtrees(cache, max_nodes=100)
    assert out is not None and out["nodes"] == out["shown"] == 7  # system, 2 tails, [6, 7] and 2 below it, tenant
    root = out["root"]
    assert root["subtree_tokens"] == cache.total_size() == 64 + 3 + 2 + 2 + 2 + 1 + 10
    system = root["children"][0]  # most hits first
    assert system["head_token_ids"] == SYSTEM[:48] and system["tokens"] == 64 and system["depth_tokens"] == 0
    assert system["hit_count"] == 3 and len(system["children"]) == 3 and system["namespace"] is None
    for node in walk(root):
        assert node["subtree_tokens"] == node["tokens"] + sum(c["subtree_tokens"] for c in node["children"])
    tenant = root["children"][1]
    assert tenant["namespace"] == namespace_id("tenant") and tenant["tokens"] == 10


def test_a_budget_keeps_the_hottest_connected_part() -> None:
    cache = create_prefix_cache("radix", TokenAllocator(4096))
    for i in range(20):
        serve(cache, SYSTEM + [i, i + 1])
    serve(cache, [9])  # cold and small: ranks below every branch of the system prompt
    out = hot_subtrees(cache, max_nodes=5)
    assert out is not None and out["shown"] == 5 and out["nodes"] == 22
    [system] = [c for c in out["root"]["children"] if c["tokens"] == 64]  # [9] lost its place
    assert len(out["root"]["children"]) == 1 and len(system["children"]) == 4
    assert system["subtree_tokens"] == 64 + 20 * 2  # sizes count the whole subtree, shown or not


def test_visible_keeps_one_namespace_and_none_for_other_caches() -> None:
    cache = create_prefix_cache("radix", TokenAllocator(4096))
    serve(cache, [1, 2, 3, 4], extra_key="alice")
    serve(cache, [1, 2, 3, 5], extra_key="bob")
    out = hot_subtrees(cache, visible=lambda ns: ns == "bob")
    assert out is not None and [n["head_token_ids"] for n in walk(out["root"])] == [[1, 2, 3, 5]]
    assert hot_subtrees(create_prefix_cache("block", TokenAllocator(1024), page_size=16)) is None
