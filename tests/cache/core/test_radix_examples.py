"""The chapter's worked examples and the tree's named behaviours, one test each."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from radixserve.cache import RadixCache, RadixKey
from radixserve.cache.core.policy import LRUStrategy
from radixserve.cache.core.radix_check import check_slot_conservation
from radixserve.memory import TokenAllocator
from tests.cache.helpers import counter_clock, serve, start, tokens

SYSTEM, FEWSHOT = tokens(512), tokens(1543)
R1 = SYSTEM + FEWSHOT + tokens(96)
R2 = SYSTEM + FEWSHOT + tokens(80)
R3 = SYSTEM + tokens(2112)


def make_cache(size: int = 20_000, page_size: int = 1, policy: str = "lru") -> RadixCache:
    return RadixCache(TokenAllocator(size, page_size), page_size, policy, counter_clock())


def test_three_requests_store_4343_tokens_not_6910() -> None:
    cache = make_cache()
    for request in (R1, R2, R3):
        serve(cache, request)
        cache.check_invariants()
    assert len(R1) + len(R2) + len(R3) == 6910
    assert cache.total_size() == 4343
    assert cache.allocator.free_size() == cache.allocator.size - 4343


def test_demo_split_of_123_into_12_then_3() -> None:
    cache = make_cache(64)
    for request in ([1, 2, 3], [1, 2, 3]):
        serve(cache, request)
    assert [len(c.key) for c in cache.root.children.values()] == [3]
    serve(cache, [1, 2, 4, 5])
    (top,) = cache.root.children.values()
    assert top.key.token_ids.tolist() == [1, 2]
    assert sorted(c.key.token_ids.tolist() for c in top.children.values()) == [[3], [4, 5]]
    serve(cache, [1, 2, 4, 5, 6, 7])
    serve(cache, [8, 9, 10, 11, 12])
    indices, node = cache.match_prefix(RadixKey([1, 2, 3, 13, 14]))
    assert len(indices) == 3 and node.key.token_ids.tolist() == [3]
    assert cache.total_size() == 12
    cache.check_invariants()


def test_locked_system_prompt_survives_evict_and_dead_rag_leaf_goes() -> None:
    cache = make_cache(600_000)
    serve(cache, SYSTEM + tokens(2112))  # the dead RAG request
    conversations = [start(cache, SYSTEM + tokens(20)) for _ in range(400)]
    assert all(req.cache_protected_len == 512 for req in conversations)
    assert cache.protected_size() == 512 and cache.evictable_size() == 2112

    assert cache.evict(300) == 2112  # the whole dead leaf, in one pop
    assert cache.total_size() == 512
    indices, _ = cache.match_prefix(RadixKey(SYSTEM))
    assert len(indices) == 512
    cache.check_invariants()
    check_slot_conservation(cache, conversations)
    for req in conversations:
        cache.cache_finished_req(req)
    cache.check_invariants()


def test_r2_after_r1_splits_at_2055_and_matches_2055() -> None:
    cache = make_cache()
    serve(cache, R1)
    (node,) = cache.root.children.values()
    assert len(node.key) == 2151
    indices, last = cache.match_prefix(RadixKey(R2))
    assert len(indices) == 2055 and len(last.key) == 2055
    (child,) = last.children.values()
    assert len(child.key) == 96
    assert serve(cache, R2) == 2055  # only the 80 new tokens needed slots
    assert cache.total_size() == 2151 + 80
    cache.check_invariants()


def test_page_size_16_rounds_matches_down() -> None:
    cache = make_cache(1024, page_size=16)
    prompt = tokens(40)
    serve(cache, prompt)
    assert cache.total_size() == 32  # the 8-token partial page is not cached
    assert len(cache.match_prefix(RadixKey(prompt)).indices) == 32
    diverging = prompt[:20] + tokens(30)
    assert len(cache.match_prefix(RadixKey(diverging)).indices) == 16
    assert serve(cache, diverging) == 16
    cache.check_invariants()
    assert cache.allocator.free_size() + cache.total_size() == cache.allocator.size


def test_cache_salts_never_share_a_node_and_same_salt_hits() -> None:
    cache = make_cache()
    prompt = tokens(100)
    serve(cache, prompt, extra_key="tenant-a")
    assert serve(cache, prompt, extra_key="tenant-b") == 0
    assert serve(cache, prompt) == 0  # no namespace is a namespace too
    assert len(cache.root.children) == 3
    assert serve(cache, prompt, extra_key="tenant-a") == 100
    cache.check_invariants()


def test_comparing_keys_of_two_namespaces_raises() -> None:
    with pytest.raises(ValueError, match="extra_key"):
        RadixKey([1, 2], "a").match(RadixKey([1, 2], "b"))


def test_locked_leaf_is_not_evicted_and_unlock_makes_it_evictable() -> None:
    cache = make_cache(64)
    req = start(cache, [1, 2, 3, 4])
    cache.cache_unfinished_req(req)  # now cached and locked by the running request
    assert cache.evict(100) == 0 and cache.protected_size() == 4
    cache.cache_finished_req(req)
    assert cache.evictable_size() == 4 and cache.evict(1) == 4
    assert cache.allocator.free_size() == 64


def test_evict_cascades_up_a_dead_branch_in_one_call() -> None:
    cache = make_cache(64)
    serve(cache, [1, 2, 3])
    serve(cache, [1, 2, 4])  # tree: [1,2] -> {[3], [4]}
    assert cache.evict(3) == 4  # both leaves (2), then their parent joins and goes too (2)
    assert cache.total_size() == 0 and not cache.root.children


def test_unbalanced_unlock_raises() -> None:
    cache = make_cache(64)
    req = start(cache, [1, 2, 3])
    cache.cache_unfinished_req(req)
    node = req.last_node
    cache.cache_finished_req(req)
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.dec_lock_ref(node)


def test_reset_frees_everything_but_refuses_while_locked() -> None:
    cache = make_cache(64)
    serve(cache, [1, 2, 3])
    req = start(cache, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.cache_finished_req(req)
    cache.reset()
    assert cache.total_size() == 0 and cache.allocator.free_size() == 64


def test_hit_count_counts_reuse_and_split_inherits_it() -> None:
    cache = make_cache(64)
    serve(cache, [1, 2, 3, 4])
    serve(cache, [1, 2, 3, 4])
    serve(cache, [1, 2, 9])
    (top,) = cache.root.children.values()
    assert top.key.token_ids.tolist() == [1, 2] and top.hit_count == 2
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node.hit_count == 1


def test_turn_counts_the_finished_requests_a_leaf_continues_not_the_ones_beside_it() -> None:
    """Each turn re-reads all but its predecessor's partial last page: turns 0, 1, 2; a second conversation on
    the same system prompt starts at turn 0, so does a third branch below a turn; a running request's chunk ends
    no turn."""
    cache = make_cache()
    system, turn0, turn1, turn2 = tokens(64), tokens(100), tokens(60), tokens(30)
    serve(cache, system + turn0 + tokens(5))
    serve(cache, system + turn0 + turn1 + tokens(7))
    serve(cache, system + turn0 + turn1 + turn2)
    node = cache.match_prefix(RadixKey(system + turn0 + turn1 + turn2)).last_node
    turns = []
    while node is not cache.root:
        turns.append((len(node.key), node.turn, node.ends))
        node = node.parent
    assert turns[::-1] == [(164, 0, 1), (60, 1, 1), (30, 2, 1)]  # the cut-off partial pages kept their ends too
    other = system + tokens(90)
    serve(cache, other)  # cuts the first conversation's head in its first half: the system prompt ends no turn
    assert cache.match_prefix(RadixKey(other)).last_node.turn == 0
    assert cache.match_prefix(RadixKey(system)).last_node.ends == 0
    retry = system + turn0 + tokens(20)  # a third branch below turn 0 (beside turn 1 and the partial page)
    serve(cache, retry)
    assert cache.match_prefix(RadixKey(retry)).last_node.turn == 0
    running = other + tokens(40)
    req = start(cache, running)
    cache.cache_unfinished_req(req)  # a chunk of a running request
    chunk = cache.match_prefix(RadixKey(running)).last_node
    assert (chunk.turn, chunk.ends) == (1, 0)
    cache.cache_finished_req(req)
    assert chunk.ends == 1
    cache.check_invariants()


def test_lfu_keeps_the_popular_leaf_where_lru_would_not() -> None:
    for policy, survivor in (("lru", [5, 6]), ("lfu", [1, 2])):
        cache = make_cache(64, policy=policy)
        for _ in range(3):
            serve(cache, [1, 2])
        serve(cache, [5, 6])
        cache.evict(1)
        assert len(cache.match_prefix(RadixKey(survivor)).indices) == 2, policy


def test_slru_protects_a_node_after_one_reuse_as_sglang_does() -> None:
    cache = make_cache(64, policy="slru")
    serve(cache, [1, 2])
    serve(cache, [1, 2])  # reused once: protected (SGLang counts the insert as a hit: its 2 is our 1)
    serve(cache, [3, 4])
    serve(cache, [5, 6])  # never reused, but the most recent
    cache.evict(2)
    assert len(cache.match_prefix(RadixKey([1, 2])).indices) == 2  # LRU would have taken it: the oldest
    assert len(cache.match_prefix(RadixKey([3, 4])).indices) == 0
    assert len(cache.match_prefix(RadixKey([5, 6])).indices) == 2


def test_priority_policy_evicts_low_priority_first() -> None:
    cache = make_cache(64, policy="priority")
    for prompt, priority in (([1, 2], 5), ([3, 4], 0)):
        req = cache.open_request(RadixKey(prompt))
        req.priority = priority
        assert cache.extend_request(req, np.asarray(prompt))
        cache.cache_finished_req(req)
    serve(cache, [3, 4])  # more recent, still low priority
    cache.evict(1)
    assert len(cache.match_prefix(RadixKey([1, 2])).indices) == 2


def test_chunked_request_shares_its_prefix_and_keeps_its_partial_page() -> None:
    cache = make_cache(64, page_size=4)
    req = start(cache, list(range(1, 11)))  # 10 tokens: two full pages + 2
    cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 8 and cache.protected_size() == 8
    other = start(cache, list(range(1, 9)) + [99] * 4)
    assert other.cache_protected_len == 8  # shares the running request's chunk
    check_slot_conservation(cache, [req, other])
    assert cache.extend_request(req, np.asarray([11, 12, 13]))  # fills the partial page first
    assert req.kv_indices[10] == req.kv_indices[9] + 1
    check_slot_conservation(cache, [req, other])
    for r in (req, other):
        cache.cache_finished_req(r)
    cache.check_invariants()
    check_slot_conservation(cache, [])


def test_pretty_print_shows_lengths_tokens_and_locks() -> None:
    cache = make_cache(64)
    serve(cache, [1, 2, 3])
    req = start(cache, [1, 2, 4])
    text = cache.pretty_print()
    assert "2 [1, 2] r=1" in text and "1 [3] r=0" in text
    cache.cache_finished_req(req)


class _TailFirst(LRUStrategy):
    """A strategy that frees one token of a leaf at a time (the extension point the Belady bound uses)."""

    def evict_len(self, node: Any, node_len: int, wanted: int) -> int:
        return 1


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_strategy_may_free_only_a_leafs_tail_in_whole_pages(page_size: int) -> None:
    cache = RadixCache(TokenAllocator(64, page_size), page_size, _TailFirst(), counter_clock())
    serve(cache, [1, 2, 3, 4, 5, 6])
    assert cache.evict(1) == page_size  # one token asked, rounded up to a page: the head stays cached
    assert cache.cached_len(RadixKey([1, 2, 3, 4, 5, 6])) == 6 - page_size
    cache.check_invariants()
    assert cache.evict(100) == 6 - page_size  # the rest, page by page, the head last
    assert cache.total_size() == 0 and cache.allocator.free_size() == cache.allocator.size
