"""The minisim policy: its shadows keep their strategies' orders, its sample is spatial, and the tree evicts by the
shadow that leads, never a locked leaf; deterministic and bounded on a production trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.traces import load_scaled_trace
from benchmarks.workloads import make_workload
from radixserve.cache import RadixCache, RadixKey
from radixserve.cache.core.policy import LFUStrategy, LRUStrategy, SLRUStrategy
from radixserve.cache.learned.dueling import DuelingCandidates
from radixserve.cache.learned.minisim import SHADOWS, BlockSampler
from radixserve.memory import TokenAllocator
from tests.cache.helpers import counter_clock, serve, start

SLICE = Path(__file__).parents[2] / "benchmarks" / "data" / "mooncake_conversation_head200.jsonl"
RANKS = {"lru": LRUStrategy().rank, "slru": SLRUStrategy().rank, "lfu": LFUStrategy().rank}


class Stats:
    """A block as the strategies rank a tree node: last access (a tick per touch), reuses."""

    def __init__(self, tick: int) -> None:
        self.last_access_time, self.hit_count, self.priority, self.depth = float(tick), 0, 0, 0


@pytest.mark.parametrize("policy", sorted(SHADOWS))
def test_each_shadow_evicts_in_its_strategys_order(policy: str) -> None:
    """Random lookups and inserts of short block paths: the shadow's order is always the strategy's rank over
    the blocks' statistics (a lookup refreshes, an insert counts a reuse on a present block)."""
    rng = np.random.default_rng(0)
    shadow, ref, tick = SHADOWS[policy](12, 32), {}, 0
    for _ in range(400):
        names = rng.integers(0, 40, size=int(rng.integers(1, 5))).tolist()
        names = list(dict.fromkeys(names))  # one block once per request, as prefix names are
        if rng.random() < 0.4:
            shadow.lookup(names)
            for name in reversed(names):
                if name in ref:
                    tick += 1
                    ref[name].last_access_time = float(tick)
        else:
            shadow.insert(names)
            for name in reversed(names):
                tick += 1
                if name in ref:
                    ref[name].hit_count += 1
                    ref[name].last_access_time = float(tick)
                else:
                    ref[name] = Stats(tick)
            while len(ref) > shadow.capacity:
                del ref[min(ref, key=lambda n: RANKS[policy](ref[n]))]
        assert shadow.order() == sorted(ref, key=lambda n: RANKS[policy](ref[n]))
        assert shadow.size == len(ref) <= shadow.capacity


def test_the_sample_is_spatial_and_names_follow_prefixes() -> None:
    every = BlockSampler(4, 1.0)
    a = RadixKey(list(range(1, 13)))
    b = RadixKey([*range(1, 9), 99, 98, 97, 96])  # the same first two blocks, then another
    names_a, names_b = every.sampled(a), every.sampled(b)
    assert len(names_a) == 3 and names_a[:2] == names_b[:2] and names_a[2] != names_b[2]
    assert every.sampled(RadixKey(list(range(1, 13)), "tenant"))[0] != names_a[0]  # namespaces never share
    assert every.sampled(RadixKey([1, 2, 3])) == []  # no whole block
    rng = np.random.default_rng(1)
    keys = [RadixKey(rng.integers(0, 50_000, size=64)) for _ in range(500)]
    quarter = BlockSampler(4, 0.25)
    picked = [quarter.sampled(k) for k in keys]
    assert picked == [BlockSampler(4, 0.25).sampled(k) for k in keys]  # a hash, not a draw
    share = sum(map(len, picked)) / (16 * len(keys))
    assert abs(share - 0.25) < 0.03, share
    assert all(set(p) <= set(every.sampled(k)) for p, k in zip(picked, keys, strict=True))


def test_never_evicts_a_locked_leaf_under_any_choice() -> None:
    for name in ("lru", "lfu", "slru"):
        cache = RadixCache(TokenAllocator(12), 1, "minisim", counter_clock())
        serve(cache, [1, 2, 3, 4])
        serve(cache, [1, 2, 3, 4])  # reused: LFU and SLRU keep it longest
        held = start(cache, [1, 2, 3, 4, 5])  # in flight: [1..4] locked
        serve(cache, [7, 8, 9])
        serve(cache, [10, 11])
        candidates = cache.candidates
        assert isinstance(candidates, DuelingCandidates)
        candidates.choose(name)
        assert cache.evict(100) == 5  # [7, 8, 9] and [10, 11]; the locked [1..4] stays
        assert cache.protected_size() == 4 and cache.evictable_size() == 0 and len(candidates) == 0
        cache.cache_finished_req(held)
        assert cache.cached_len(RadixKey([1, 2, 3, 4, 5])) == 5
        cache.check_invariants()
        candidates.check()


def replay(requests: list[np.ndarray], capacity: int, clock: bool) -> tuple[list[int], list[str], DuelingCandidates]:
    now = [0.0]
    cache = RadixCache(TokenAllocator(capacity), 1, "minisim", (lambda: now[0]) if clock else counter_clock())
    candidates = cache.candidates
    assert isinstance(candidates, DuelingCandidates)
    hits, choices = [], []
    for i, tokens in enumerate(requests):
        now[0] = float(i)
        hits.append(serve(cache, tokens.tolist()))
        choices.append(candidates.choice)
        assert all(s.size <= s.capacity for s in candidates.shadows.values()), "a shadow past its bound"
        assert len(candidates) <= cache.total_size()
    candidates.check()
    cache.check_invariants()
    return hits, choices, candidates


def test_bounded_and_deterministic_on_a_production_trace() -> None:
    prompts = [r.prompt for r in load_scaled_trace(SLICE)]
    first, choices, state = replay(prompts, 8000, True)
    second, again, _ = replay(prompts, 8000, True)
    assert first == second and choices == again  # same trace, same decisions: nothing else is read
    assert sum(first) > 0 and state.lookup_tokens > 0
    assert max(s.capacity for s in state.shadows.values()) <= max(state.MIN_SHADOW_BLOCKS, 8000 // 32)


def test_the_shadows_choose_frequency_on_popular_documents_and_recency_on_chat() -> None:
    rag = make_workload("rag", num_requests=400, seed=0, num_docs=40, doc_len=(300, 600))
    _, choices, _ = replay([np.concatenate([r.prompt, r.output]) for r in rag], 4000, False)
    assert choices[-1] in ("lfu", "slru")
    chat = make_workload("support-agent", seed=0, num_users=60, turns_per_user=6)
    _, choices, state = replay([np.concatenate([r.prompt, r.output]) for r in chat], 6000, False)
    assert state.switches > 0 and choices[-1] == "lru"  # it starts on LFU: the shadows moved it
