"""``bench simulate`` with tiers: what L1 evicts comes back from L2 / L3 instead of being recomputed."""

from __future__ import annotations

from benchmarks.simulate import replay
from benchmarks.traces import working_set_tokens
from benchmarks.workloads import make_workload


def test_tiers_recover_what_the_pool_evicts() -> None:
    requests = make_workload("rag", num_requests=120, seed=1)
    capacity = working_set_tokens(requests) // 4
    single = replay(requests, "radix-lru-p1", capacity)
    tiered = replay(requests, "tiered-lru-p1", capacity)
    assert single.tier_hit_tokens is None and tiered.tier_hit_tokens is not None
    loaded = tiered.tier_hit_tokens["host"] + tiered.tier_hit_tokens["disk"]
    assert tiered.tier_hit_tokens["host"] > 0 and tiered.tier_hit_tokens["disk"] > 0
    assert tiered.cached_tokens > single.cached_tokens and loaded <= tiered.cached_tokens
    # L3 is unbounded: as good as a pool holding everything, but for partial tier pages at evicted leaves
    unbounded = replay(requests, "radix-lru-p1", 4 * working_set_tokens(requests))
    assert tiered.prefill_tokens <= unbounded.prefill_tokens + 16 * len(requests)
