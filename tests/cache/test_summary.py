"""summarize(): the /cache endpoint's view of each cache variant."""

from __future__ import annotations

from radixserve.cache import create_prefix_cache
from radixserve.cache.summary import namespace_id, summarize
from radixserve.memory import TokenAllocator
from tests.cache.helpers import serve, start

SYSTEM = list(range(100, 164))  # a 64-token shared prefix


def test_radix_summary_ranks_the_shared_prefix_first() -> None:
    cache = create_prefix_cache("radix", TokenAllocator(4096))
    for tail in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        serve(cache, SYSTEM + tail)
    serve(cache, [7] * 10, extra_key="tenant")
    live = start(cache, SYSTEM + [1, 2, 50])  # locks the shared prefix; 1 private slot
    out = summarize(cache, top_k=3)
    # 6 nodes: the live match split [1, 2, 3] into [1, 2] -> [3]
    assert out["kind"] == "radix" and out["nodes"] == 6 and out["leaves"] == 4 and out["namespaces"] == 2
    assert out["cached_tokens"] == 64 + 3 + 2 + 4 + 10 == out["evictable_tokens"] + out["protected_tokens"]
    assert out["free_tokens"] + out["cached_tokens"] + 1 == out["pool_tokens"]  # 1: the live request's own slot
    top = out["top_shared_prefixes"][0]  # hit_count 2: the first insert created it, two reused it
    assert top["tokens"] == 64 and top["children"] == 3 and top["hit_count"] == 2 and top["lock_ref"] == 1
    assert top["head_token_ids"] == SYSTEM[:48] and top["tail_token_ids"] == SYSTEM[48:]
    assert all(p["namespace"] is None for p in out["top_shared_prefixes"])
    cache.cache_finished_req(live, is_insert=False)


def test_namespaces_show_as_hashes_never_as_the_salt() -> None:
    cache = create_prefix_cache("radix", TokenAllocator(1024))
    for _ in range(3):  # created, then reused twice
        serve(cache, [5, 6, 7], extra_key="secret-salt")
    [prefix] = summarize(cache)["top_shared_prefixes"]
    assert prefix["namespace"] == namespace_id("secret-salt") != "secret-salt"
    assert "secret-salt" not in repr(summarize(cache))


def test_block_and_none_summaries() -> None:
    block = create_prefix_cache("block", TokenAllocator(1024), page_size=16)
    serve(block, list(range(40)))
    out = summarize(block)
    assert out["kind"] == "block" and out["blocks"] == 2 and out["cached_tokens"] == 32 and out["block_size"] == 16
    none = summarize(create_prefix_cache("none", TokenAllocator(1024)))
    assert none["kind"] == "none" and none["cached_tokens"] == 0 and none["free_tokens"] == 1024
