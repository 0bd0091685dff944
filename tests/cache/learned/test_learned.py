"""The learned eviction policy (ARC over the leaves): what its ghosts teach it, and what it never does."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.traces import load_scaled_trace
from benchmarks.workloads import make_workload
from radixserve.cache import RadixCache, RadixKey
from radixserve.cache.learned.candidates import LearnedCandidates
from radixserve.memory import TokenAllocator
from tests.cache.helpers import counter_clock, serve, start

SLICE = Path(__file__).parents[2] / "benchmarks" / "data" / "mooncake_conversation_head200.jsonl"


def make_cache(size: int) -> RadixCache:
    return RadixCache(TokenAllocator(size), 1, "learned", counter_clock())


def learned(cache: RadixCache) -> LearnedCandidates:  # type: ignore[type-arg]
    assert isinstance(cache.candidates, LearnedCandidates)
    return cache.candidates


def test_a_seen_once_ghost_grows_the_share_a_reused_one_shrinks_it() -> None:
    cache = make_cache(8)
    serve(cache, [1, 2, 3, 4])
    serve(cache, [5, 6, 7, 8])
    serve(cache, [9, 10, 11, 12])  # full: the least recent seen-once leaf, [1..4], goes
    assert learned(cache).share == LearnedCandidates.INITIAL_SHARE
    serve(cache, [1, 2, 3, 4])  # back where its ghost hung: the seen-once segment deserved more room
    grown = learned(cache).share
    assert grown > LearnedCandidates.INITIAL_SHARE
    assert serve(cache, [1, 2, 3, 4]) == 4  # reused now: in T2
    learned(cache).share = 1.0  # T1 may fill everything: T2 goes first
    serve(cache, [20, 21, 22, 23])
    assert cache.cached_len(RadixKey([1, 2, 3, 4])) == 0  # the reused leaf went, as the share says
    serve(cache, [1, 2, 3, 4])
    assert learned(cache).share < 1.0  # its ghost came back: the reused segment deserved more
    cache.check_invariants()
    learned(cache).check()


def test_never_evicts_a_locked_leaf_and_frees_every_unlocked_one() -> None:
    cache = make_cache(12)
    serve(cache, [1, 2, 3, 4])
    serve(cache, [1, 2, 3, 4])  # reused: the leaf sits in T2, the one the share shields least when it is 1
    held = start(cache, [1, 2, 3, 4, 5])  # in flight: [1..4] locked, [5] its private tail
    serve(cache, [7, 8, 9])
    serve(cache, [10, 11])
    learned(cache).share = 1.0  # T2 first: still never the locked leaf
    assert cache.evict(100) == 5  # [7, 8, 9] and [10, 11]; the locked [1..4] stays
    assert cache.protected_size() == 4 and cache.evictable_size() == 0 and len(learned(cache)) == 0
    cache.cache_finished_req(held)
    assert cache.cached_len(RadixKey([1, 2, 3, 4, 5])) == 5
    cache.check_invariants()


def replay_slice(capacity: int) -> tuple[list[int], LearnedCandidates, RadixCache]:  # type: ignore[type-arg]
    """The committed Mooncake slice, one request at a time, on its own timestamps as the clock."""
    now = [0.0]
    cache = RadixCache(TokenAllocator(capacity), 1, "learned", lambda: now[0])
    hits = []
    for request in load_scaled_trace(SLICE):
        now[0] = request.timestamp or 0.0
        hits.append(serve(cache, request.prompt.tolist()))
        state = learned(cache)
        assert all(n <= state.ghost_capacity_len for n in state.ghost_len), "ghosts past their bound"
        assert len(state) <= cache.total_size()
    return hits, learned(cache), cache


def test_bounded_and_deterministic_on_a_production_trace() -> None:
    first, state, cache = replay_slice(16000)
    second, again, _ = replay_slice(16000)
    assert first == second and state.share == again.share  # same trace, same decisions: nothing else is read
    assert sum(first) > 0 and cache.evicted_tokens > 0 and state.share != LearnedCandidates.INITIAL_SHARE
    cache.check_invariants()
    state.check()


def test_popular_documents_pull_the_share_down() -> None:
    """RAG: a reused document outlives the one-off questions (frequency); the share falls below its start."""
    cache = RadixCache(TokenAllocator(6000), 1, "learned", counter_clock())
    for request in make_workload("rag", num_requests=300, seed=0, num_docs=20, doc_len=(300, 600)):
        serve(cache, np.concatenate([request.prompt, request.output]).tolist())
    assert learned(cache).share < LearnedCandidates.INITIAL_SHARE
    learned(cache).check()


def test_top_level_and_deeper_ghosts_move_the_top_share() -> None:
    cache = make_cache(8)
    serve(cache, [1, 2, 3, 4])
    serve(cache, [1, 2, 3, 4, 5, 6])  # [1..4] reused (T2, inside now); [5, 6] a seen-once leaf below it
    serve(cache, [9, 10])  # a seen-once leaf at the top level
    serve(cache, [11, 12])  # full: T1's top level holds half of T1, not more: the deepest goes, [5, 6]
    assert cache.cached_len(RadixKey([1, 2, 3, 4, 5, 6])) == 4
    serve(cache, [1, 2, 3, 4, 5, 6])  # back where the deeper ghost hung: the top level should give way ...
    shrunk = learned(cache).top_share
    assert shrunk < LearnedCandidates.INITIAL_SHARE
    assert cache.cached_len(RadixKey([9, 10])) == 0  # ... and did: its least recent made room for [5, 6]
    assert cache.cached_len(RadixKey([11, 12])) == 2 and cache.cached_len(RadixKey([1, 2, 3, 4, 5, 6])) == 6
    serve(cache, [9, 10])  # back where a top-level ghost hung
    assert learned(cache).top_share > shrunk
    learned(cache).check()
