"""The ``when`` eviction policy: what its gaps teach it, the order it draws from them, and what it never does."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import pytest

from benchmarks.traces import load_scaled_trace
from radixserve.cache import RadixCache, RadixKey
from radixserve.cache.learned.when import NUM_CLASSES, WhenCandidates, leaf_class
from radixserve.memory import TokenAllocator
from tests.cache.helpers import counter_clock, serve, start

SLICE = Path(__file__).parents[2] / "benchmarks" / "data" / "mooncake_conversation_head200.jsonl"
_ids = count()


@dataclass(eq=False)
class Leaf:
    last_access_time: float
    hit_count: int = 0
    depth: int = 0
    length: int = 4
    id: int = field(default_factory=lambda: next(_ids))

    def __hash__(self) -> int:
        return id(self)


def candidates(capacity_len: int = 8) -> WhenCandidates[Leaf]:
    return WhenCandidates(lambda n: n.id, lambda n: ("ghost", n.id), lambda n: n.length, capacity_len)


def when(cache: RadixCache) -> WhenCandidates:  # type: ignore[type-arg]
    assert isinstance(cache.candidates, WhenCandidates)
    return cache.candidates


def test_without_a_horizon_it_is_lru() -> None:
    cands = candidates(capacity_len=100)
    leaves = [Leaf(t, hit_count=h, depth=d) for t, h, d in [(5.0, 0, 0), (1.0, 2, 7), (3.0, 1, 0), (2.0, 0, 3)]]
    for leaf in leaves:
        cands.add(leaf)
    cands.note_lookup(None, 10.0)
    assert [cands.pop() for _ in leaves] == sorted(leaves, key=lambda n: n.last_access_time)
    assert cands.pop() is None


def test_a_leaf_near_its_typical_gap_outlives_a_fresh_one() -> None:
    """Turns come 100 s apart, the pool holds 40 s: the leaf written 80 s ago is read within the horizon, the one
    written 1 s ago is not; LRU would evict the older."""
    cands = candidates()
    for _ in range(200):
        cands._observe(leaf_class(Leaf(0.0)), 100.0)
    cands.evictions.extend([(-30.0, 8)])
    cands._evicted_len = 8  # one pool evicted over the last 40 s: H = 40
    cands.note_lookup(None, 10.0)
    assert cands.horizon(10.0) == 40.0
    cands._retable(40.0)
    old, fresh = Leaf(-70.0), Leaf(9.0)
    cands.add(old)
    cands.add(fresh)
    assert cands.pop() is fresh and cands.pop() is old
    assert cands.table[0][cands._bin(80.0)] > 0.5 > 0.01 > cands.table[0][cands._bin(1.0)]


def test_gaps_come_from_accesses_and_ghosts_an_eviction_counts_as_never_until_its_ghost_is_read() -> None:
    cands = candidates(capacity_len=4)
    before = cands.counts.copy()
    a = Leaf(1.0)
    cands.add(a)
    a.last_access_time = 9.0  # read 8 s later while a candidate
    cands.refresh(a)
    assert cands.counts[0, cands._bin(8.0)] == before[0, cands._bin(8.0)] + 1
    cands.note_lookup(None, 9.0)
    assert cands.pop() is a  # evicted: never read again, as far as anyone knows; its gap started at 9
    assert cands.counts[0, -1] == before[0, -1] + 1
    cands.note_miss(("ghost", a.id), 13.0)  # read back 4 s later: the never becomes a 4 s gap
    assert cands.counts[0, cands._bin(4.0)] == before[0, cands._bin(4.0)] + 1
    assert cands.counts[0, -1] == max(before[0, -1] + 1 - 1, 0.0)
    for t in range(6):  # more ghosts than GHOST_REACH pools hold: the oldest are forgotten (still never)
        leaf = Leaf(20.0 + t, hit_count=2, depth=1)
        cands.add(leaf)
        cands.note_lookup(None, 30.0)
        assert cands.pop() is leaf
    assert cands.counts[leaf_class(leaf), -1] - before[leaf_class(leaf), -1] == pytest.approx(6)
    assert cands.ghost_len == 16  # GHOST_REACH (4) pools of 4 tokens: four 4-token ghosts
    cands.note_miss(("ghost", leaf.id - 5), 40.0)  # a forgotten ghost teaches nothing
    assert cands.counts[leaf_class(leaf), -1] - before[leaf_class(leaf), -1] == pytest.approx(6)
    cands.check()


def test_never_evicts_a_locked_leaf_and_frees_every_unlocked_one() -> None:
    cache = RadixCache(TokenAllocator(12), 1, "when", counter_clock())
    serve(cache, [1, 2, 3, 4])
    serve(cache, [1, 2, 3, 4])
    held = start(cache, [1, 2, 3, 4, 5])  # in flight: [1..4] locked, [5] its private tail
    serve(cache, [7, 8, 9])
    serve(cache, [10, 11])
    assert cache.evict(100) == 5  # [7, 8, 9] and [10, 11]; the locked [1..4] stays
    assert cache.protected_size() == 4 and cache.evictable_size() == 0 and len(when(cache)) == 0
    cache.cache_finished_req(held)
    assert cache.cached_len(RadixKey([1, 2, 3, 4, 5])) == 5
    cache.check_invariants()
    when(cache).check()


def replay_slice(capacity: int) -> tuple[list[int], WhenCandidates, RadixCache]:  # type: ignore[type-arg]
    """The committed Mooncake slice, one request at a time, on its own timestamps as the clock."""
    now = [0.0]
    cache = RadixCache(TokenAllocator(capacity), 1, "when", lambda: now[0])
    hits = []
    for request in load_scaled_trace(SLICE):
        now[0] = request.timestamp or 0.0
        hits.append(serve(cache, request.prompt.tolist()))
        state = when(cache)
        assert state.ghost_len <= state.GHOST_REACH * capacity, "ghosts past their bound"
        assert len(state.evictions) <= capacity and float(state.counts.sum(axis=1).max()) <= state.MAX_COUNT + 1
    return hits, when(cache), cache


def test_bounded_and_deterministic_on_a_production_trace() -> None:
    first, state, cache = replay_slice(16000)
    second, again, _ = replay_slice(16000)
    assert first == second and (state.table == again.table).all()  # same trace, same decisions
    assert sum(first) > 0 and cache.evicted_tokens > 0
    assert state.horizon(state.now) is not None and not math.isnan(state._table_horizon)
    assert state.counts.shape == (NUM_CLASSES, state.NUM_BINS + 1)
    cache.check_invariants()
    state.check()
