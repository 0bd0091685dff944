"""``bench insertion``: the stack-distance premise test and the insertion policies (invariants, order, determinism)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from benchmarks.eviction_heldout import run
from benchmarks.insertion_policies import INSERTION, LeafBIP, TurnOdds, TurnOddsInsertion
from benchmarks.simulate import SimResult, read_trace, replay
from benchmarks.stack_curve import block_names, stack_distances
from benchmarks.workloads import TraceRequest
from radixserve.cache import RadixKey
from radixserve.cache.core.policy import EvictionStrategy
from radixserve.cache.core.radix import RadixCache
from radixserve.memory import TokenAllocator
from tests.cache.helpers import serve

SLICE = Path(__file__).parent / "data" / "mooncake_conversation_head200.jsonl"


def test_stack_distances_count_distinct_names_between_reads() -> None:
    rng = random.Random(0)
    names = [rng.randrange(6) for _ in range(300)]
    expected = []
    for t, name in enumerate(names):
        earlier = [p for p in range(t) if names[p] == name]
        expected.append(len(set(names[earlier[-1] + 1 : t])) if earlier else -1)
    assert stack_distances(names).tolist() == expected


def test_blocks_are_named_by_their_whole_prefix() -> None:
    def request(*blocks: int) -> TraceRequest:
        return TraceRequest(np.repeat(np.array(blocks, dtype=np.int64), 4), np.zeros(0, dtype=np.int64))

    names = block_names([request(1, 2), request(1, 3), request(2, 2)], 4)
    assert len(names) == 6 and names[0] == names[2] and names[1] != names[3]  # same first block, other second
    assert names[5] != names[1] and names[4] != names[0]  # block 2 after block 2 is not block 2 after block 1


def test_leaf_bip_evicts_fresh_leaves_newest_first_then_by_recency() -> None:
    now = [0.0]
    cache = RadixCache(TokenAllocator(64), 1, LeafBIP(), clock=lambda: now[0])
    for t, first in enumerate((1, 2, 3)):
        now[0] = float(t)
        key = RadixKey(np.array([first] * 4, dtype=np.int64))
        cache.insert(key, cache.allocator.alloc(4))
    now[0] = 5.0
    cache.match_prefix(RadixKey(np.array([1] * 4, dtype=np.int64)))  # read: promoted, behind every fresh leaf
    order = []
    while cache.evict(1):
        order.append(int(cache.allocator.free_size()))
    assert order == [64 - 8, 64 - 4, 64]  # leaf 3 (newest fresh), leaf 2, then the read leaf 1
    cache.check_invariants()


def test_turn_odds_learns_which_turns_are_read_and_shifts_the_fresh_leaves_by_them() -> None:
    """Openings evicted unread, second turns read: a fresh opening goes before an older fresh second turn, which
    LRU would evict first; a ghost read back turns a miss into a read."""
    now = [0.0]
    cache = RadixCache(TokenAllocator(64), 1, TurnOddsInsertion(1.0, "turn"), clock=lambda: now[0])
    odds = cache.candidates
    assert isinstance(odds, TurnOdds)
    odds.counts = {(0, 0): [0.0, 50.0], (1, 0): [50.0, 0.0]}
    odds.pool_age = 10.0
    first = [7] * 4
    serve(cache, first)  # an opening, t = 0
    now[0] = 1.0
    serve(cache, [*first[:3], 8, 8])  # continues the opening (all but its last page): a second turn, t = 1
    assert odds.counts[(0, 0)][0] == 1.0  # the opening's head was read (the split)
    now[0] = 2.0
    serve(cache, [9] * 4)  # a new opening, t = 2
    assert cache.evict(1) == 1 and cache.evict(1) == 4  # the dead partial page, then the new opening
    assert cache.cached_len(RadixKey([*first[:3], 8, 8])) == 5  # the older second turn stays
    misses = odds.counts[(0, 0)][1]
    cache.match_prefix(RadixKey([9] * 4))  # the evicted opening is asked for again: a read after all
    assert odds.counts[(0, 0)][1] == misses - 1
    odds.check()
    cache.check_invariants()


class CheckedCache(RadixCache):
    """Checks every invariant around each eviction (candidates == unlocked leaves, the policy's own check)."""

    def evict(self, num_tokens: int) -> int:
        self.check_invariants()
        freed = super().evict(num_tokens)
        self.check_invariants()
        return freed


def _replay(requests: list[TraceRequest], make: Callable[[], EvictionStrategy]) -> tuple[SimResult, RadixCache]:
    caches = []

    def factory(clock: list[float]) -> RadixCache:
        caches.append(CheckedCache(TokenAllocator(2048), 1, make(), clock=lambda: float(clock[1])))
        return caches[-1]

    return replay(requests, "checked", 2048, concurrency=4, trace_clock=True, factory=factory), caches[0]


@pytest.mark.parametrize("name", sorted(INSERTION))
def test_insertion_policies_keep_the_invariants_and_replay_deterministically(name: str) -> None:
    requests = read_trace(f"mooncake:{SLICE}", 512, 32, None, "all")
    (first, cache), (second, _) = _replay(requests, INSERTION[name]), _replay(requests, INSERTION[name])
    assert first.evicted_tokens > 0  # the pool was under pressure
    assert (first.cached_tokens, first.evicted_tokens) == (second.cached_tokens, second.evicted_tokens)
    cache.check_invariants()
    remembered = getattr(cache.strategy, "_admitted", {})  # ConversationBIP: only nodes still in the tree
    assert set(remembered) <= set(cache.nodes())


def test_policy_table_replays_strategies_outside_the_registry() -> None:
    requests = read_trace(f"mooncake:{SLICE}", 512, 32, None, "all")
    table = run(requests, ["lru"], [0.1], True, 1, {"drrip": INSERTION["drrip"]})
    rows = table[0.1]
    assert set(rows) == {"lru", "belady", "drrip"}
    assert rows["drrip"].capacity == rows["lru"].capacity and 0.0 < rows["drrip"].hit_rate <= rows["belady"].hit_rate
