"""Schedule policies and in-batch dedup, on real caches and hand-built requests (no model)."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence

import numpy as np
import pytest

from radixserve.cache import BasePrefixCache, BlockHashCache, ChunkCache, RadixCache
from radixserve.core import SamplingParams
from radixserve.memory.allocator import TokenAllocator
from radixserve.scheduler.dedup import DEDUP_THRESHOLD_LEN
from radixserve.scheduler.policy import (
    HRRN_DECODE_RATE,
    HRRN_PREFILL_RATE,
    SCHEDULE_POLICIES,
    DFSWeightPolicy,
    HRRNPolicy,
    create_schedule_policy,
)
from radixserve.scheduler.request import Request
from tests.cache.helpers import serve

_next_token = itertools.count(1_000_000)
_next_rid = itertools.count()


def fresh(n: int) -> np.ndarray:
    """``n`` tokens no other call returns: a cold, unshared segment."""
    start = next(_next_token)
    for _ in range(n - 1):
        next(_next_token)
    return np.arange(start, start + n, dtype=np.int64)


def req(*parts: np.ndarray, max_new: int = 16, arrival: float = 0.0, **fields: object) -> Request:
    prompt = np.concatenate(parts) if parts else fresh(8)
    return Request(next(_next_rid), prompt, SamplingParams(max_new_tokens=max_new), arrival_time=arrival, **fields)  # type: ignore[arg-type]


def radix(page_size: int = 1, size: int = 1 << 16) -> RadixCache:
    return RadixCache(TokenAllocator(size, page_size), page_size)


def cached(cache: BasePrefixCache, *parts: np.ndarray, extra_key: str | None = None) -> np.ndarray:
    """Run a request on ``parts`` to completion, so the cache holds them; return the tokens."""
    tokens = np.concatenate(parts)
    serve(cache, tokens.tolist(), extra_key)
    return tokens


def rids(reqs: Sequence[Request]) -> list[int]:
    return [r.rid for r in reqs]


# ---- registry ------------------------------------------------------------------------------------


def test_every_name_builds_and_unknown_raises() -> None:
    for name in SCHEDULE_POLICIES:
        assert create_schedule_policy(name).order([], radix(), [], 0.0).order == []
    with pytest.raises(ValueError, match="unknown schedule policy"):
        create_schedule_policy("sjf")


# ---- cache-agnostic policies ---------------------------------------------------------------------


def test_fcfs_keeps_the_given_order() -> None:
    retracted = req(arrival=9.0)  # put back at the front by the scheduler: stays there
    waiting = [retracted, *(req(arrival=float(i)) for i in range(5))]
    assert create_schedule_policy("fcfs").order(waiting, radix(), [], 10.0).order == waiting


def test_lof_longest_output_first_ties_fcfs() -> None:
    waiting = [req(max_new=m) for m in (8, 64, 8, 128, 64)]
    order = create_schedule_policy("lof").order(waiting, radix(), [], 0.0).order
    assert order == [waiting[3], waiting[1], waiting[4], waiting[0], waiting[2]]


def test_priority_higher_first_ties_fcfs() -> None:
    waiting = [req(priority=p) for p in (0, 5, -1, 5, 0)]
    order = create_schedule_policy("priority").order(waiting, radix(), [], 0.0).order
    assert order == [waiting[1], waiting[3], waiting[0], waiting[4], waiting[2]]


def test_random_is_a_seeded_reproducible_permutation() -> None:
    waiting = [req() for _ in range(20)]
    first = create_schedule_policy("random", seed=7).order(waiting, radix(), [], 0.0).order
    again = create_schedule_policy("random", seed=7).order(waiting, radix(), [], 0.0).order
    other = create_schedule_policy("random", seed=8).order(waiting, radix(), [], 0.0).order
    assert first == again and sorted(rids(first)) == rids(waiting)
    assert first != waiting and other != first


def test_routing_key_most_frequent_in_running_first() -> None:
    running = [req(routing_key=k) for k in ("a", "b", "b", "b", None)]
    waiting = [req(routing_key=k) for k in (None, "a", "c", "b", "a", "b")]
    order = create_schedule_policy("routing-key").order(waiting, radix(), running, 0.0).order
    assert order == [waiting[3], waiting[5], waiting[1], waiting[4], waiting[0], waiting[2]]


# ---- cache-aware policies ------------------------------------------------------------------------


def test_lpm_longest_cached_prefix_first_ties_fcfs() -> None:
    cache = radix()
    a, b = cached(cache, fresh(100)), cached(cache, fresh(50))
    whole = req(a)  # all of it cached, but the last token is always prefilled
    waiting = [req(), req(b, fresh(5)), req(a, fresh(5)), whole, req(), req(a[:70], fresh(5))]
    order = create_schedule_policy("lpm").order(waiting, cache, [], 0.0).order
    assert order == [waiting[2], waiting[3], waiting[5], waiting[1], waiting[0], waiting[4]]
    assert [r.match_len for r in order] == [100, 99, 70, 50, 0, 0]


def test_dfs_weight_groups_subtrees_heaviest_first() -> None:
    cache = radix()
    p, x, y, q = fresh(40), fresh(20), fresh(20), fresh(40)
    for parts in ((p, x), (p, y), (q,)):
        cached(cache, *parts)
    # root -> P -> {X (3 waiting), Y (1)}; root -> Q (2); one request ends at P; one is cold.
    xs = [req(p, x, fresh(4)) for _ in range(3)]
    y1, qs, at_p, cold = req(p, y, fresh(4)), [req(q, fresh(4)) for _ in range(2)], req(p, fresh(4)), req()
    waiting = [qs[0], y1, cold, xs[0], qs[1], xs[1], at_p, xs[2]]
    order = create_schedule_policy("dfs-weight").order(waiting, cache, [], 0.0).order
    assert order == [at_p, *xs, y1, *qs, cold]


def test_dfs_weight_equal_weights_follow_arrival() -> None:
    cache = radix()
    p, q = cached(cache, fresh(40)), cached(cache, fresh(40))
    waiting = [req(q, fresh(4)), req(p, fresh(4)), req(p, fresh(4)), req(q, fresh(4))]
    order = create_schedule_policy("dfs-weight").order(waiting, cache, [], 0.0).order
    assert order == [waiting[0], waiting[3], waiting[1], waiting[2]]


def test_hrrn_admits_a_cold_request_within_the_bound_lpm_never_does() -> None:
    """One warm request arrives per round and the first of the order is admitted each round."""
    rate_prefill, rate_decode, dt, max_new = HRRN_PREFILL_RATE, HRRN_DECODE_RATE, 1.0, 8
    cache = radix()
    shared = cached(cache, fresh(1990))
    service_warm = 10 / rate_prefill + max_new / rate_decode  # 10 uncached tokens
    service_cold = 2000 / rate_prefill + max_new / rate_decode
    # Round r (now = (r+1) dt): cold ratio 1 + (r+1) dt / s_cold, the new warm one's 1 + dt / s_warm.
    bound = math.ceil(service_cold / service_warm)  # 17 rounds

    def rounds_until_cold_admitted(name: str, max_rounds: int) -> int | None:
        policy = create_schedule_policy(name)
        cold = req(fresh(2000), max_new=max_new, arrival=0.0)
        waiting = [cold]
        for r in range(max_rounds):
            waiting.append(req(shared, fresh(10), max_new=max_new, arrival=r * dt))
            admitted = policy.order(waiting, cache, [], (r + 1) * dt).order[0]
            waiting.remove(admitted)
            if admitted is cold:
                return r + 1
        return None

    rounds = rounds_until_cold_admitted("hrrn", bound)
    assert rounds is not None and rounds <= bound
    assert rounds_until_cold_admitted("lpm", 10 * bound) is None  # starved


def test_hrrn_ratio_formula() -> None:
    cache = radix()
    shared = cached(cache, fresh(600))
    policy = create_schedule_policy("hrrn")
    assert isinstance(policy, HRRNPolicy)
    r = req(shared, fresh(400), max_new=50, arrival=2.0)
    policy.order([r], cache, [], 12.0)
    assert r.match_len == 600
    service = 400 / HRRN_PREFILL_RATE + 50 / HRRN_DECODE_RATE
    assert policy.service_s(r) == pytest.approx(service)
    assert policy.response_ratio(r, 12.0) == pytest.approx((10 + service) / service)


def test_block_cache_dfs_weight_falls_back_to_lpm_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    cache = BlockHashCache(TokenAllocator(4096), 16)
    warm = cached(cache, fresh(64))
    waiting = [req(), req(warm, fresh(8)), req()]
    policy = create_schedule_policy("dfs-weight")
    assert isinstance(policy, DFSWeightPolicy)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert policy.order(waiting, cache, [], 0.0).order == [waiting[1], waiting[0], waiting[2]]
    assert policy.fallbacks == 2
    assert sum("dfs-weight needs a radix cache" in m for m in caplog.messages) == 1


@pytest.mark.parametrize("name", ["lpm", "dfs-weight", "hrrn"])
def test_chunk_cache_cache_aware_policies_give_fcfs(name: str) -> None:
    cache = ChunkCache(TokenAllocator(4096))
    shared = fresh(100)
    waiting = [req(shared, fresh(8)) for _ in range(4)]
    result = create_schedule_policy(name).order(waiting, cache, [], 0.0)
    assert result.order == waiting and not result.held  # nothing is ever cached: nothing to wait for
    assert all(r.match_len == 0 for r in waiting)


# ---- in-batch dedup ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_POLICIES)
def test_dedup_burst_on_a_cold_prefix_admits_one(name: str) -> None:
    cache = radix()
    prefix = fresh(2000)
    waiting = [req(prefix, fresh(40)) for _ in range(64)]
    policy = create_schedule_policy(name)
    result = policy.order(waiting, cache, [], 0.0)
    assert len(result.order) == 1 and len(result.held) == 63
    first = result.order[0]
    cached(cache, first.prompt_ids)  # the scheduler inserts its prompt right after its prefill
    rest = [r for r in waiting if r is not first]
    again = policy.order(rest, cache, [], 1.0)
    assert not again.held and sorted(rids(again.order)) == rids(rest)
    if name in ("lpm", "dfs-weight", "hrrn"):
        assert all(r.match_len == 2000 for r in rest)


def test_dedup_respects_namespaces() -> None:
    cache = radix()
    prefix = fresh(200)
    waiting = [req(prefix, fresh(4), extra_key=k) for k in ("a", "b", "a", None, "b", None)]
    result = create_schedule_policy("fcfs").order(waiting, cache, [], 0.0)
    assert result.order == waiting[:2] + waiting[3:4]
    assert result.held == [waiting[2], waiting[4], waiting[5]]


def test_dedup_holds_a_burst_on_a_cached_system_prompt_and_cold_shared_block() -> None:
    cache = radix()
    system = cached(cache, fresh(512))
    cold_block = fresh(1543)  # shared, not cached yet: one sibling computes it
    waiting = [req(system, cold_block, fresh(10)) for _ in range(8)]
    for name in ("fcfs", "lpm"):
        result = create_schedule_policy(name).order(waiting, cache, [], 0.0)
        assert len(result.order) == 1 and len(result.held) == 7, name
    cached(cache, np.concatenate([system, cold_block]))  # the kept one's prompt got inserted
    assert not create_schedule_policy("lpm").order(waiting, cache, [], 0.0).held


def test_dedup_does_not_hold_requests_that_share_only_the_cached_part() -> None:
    cache = radix()
    system = cached(cache, fresh(512))
    waiting = [req(system, fresh(300)) for _ in range(8)]  # distinct tails right after the cached prompt
    result = create_schedule_policy("fcfs").order(waiting, cache, [], 0.0)
    assert not result.held and result.order == waiting


def test_dedup_off_holds_nothing() -> None:
    prefix = fresh(2000)
    waiting = [req(prefix, fresh(40)) for _ in range(64)]
    result = create_schedule_policy("lpm", in_batch_dedup=False).order(waiting, radix(), [], 0.0)
    assert result.order == waiting and not result.held


@pytest.mark.parametrize(
    ("page_size", "shared_len", "held"),
    [(1, 32, True), (1, 31, False), (16, 32, True), (16, 31, False), (64, 40, False), (64, 64, True)],
)
def test_dedup_counts_shared_tokens_in_whole_pages(page_size: int, shared_len: int, held: bool) -> None:
    shared = fresh(shared_len)
    waiting = [req(shared, fresh(100)), req(shared, fresh(100))]
    result = create_schedule_policy("fcfs").order(waiting, radix(page_size), [], 0.0)
    assert (result.held == waiting[1:]) is held


def test_dedup_leaves_short_prompts_alone() -> None:
    tokens = fresh(DEDUP_THRESHOLD_LEN)  # match at most len - 1 tokens: below the threshold
    waiting = [req(tokens), req(tokens)]
    assert not create_schedule_policy("fcfs").order(waiting, radix(), [], 0.0).held


# ---- cost ----------------------------------------------------------------------------------------


def lpm_workload(
    num_waiting: int, prompt_len: int = 2000, num_groups: int = 4, shared_len: int = 1900
) -> tuple[RadixCache, list[Request]]:
    """``num_waiting`` prompts in ``num_groups`` groups, each group's shared prefix cached."""
    cache = radix(size=1 << 15)
    groups = [cached(cache, fresh(shared_len)) for _ in range(num_groups)]
    waiting = [req(groups[i % num_groups], fresh(prompt_len - shared_len)) for i in range(num_waiting)]
    return cache, waiting


def test_lpm_keeps_sorting_a_long_queue() -> None:
    """No silent switch to FCFS past 128 waiting (SGLang's cutoff): 1,000 waiting are still sorted."""
    cache, waiting = lpm_workload(1000, shared_len=1900)
    cold = [req(fresh(500)) for _ in range(3)]
    queue = cold + waiting  # the cold ones arrived first
    ordered = create_schedule_policy("lpm", in_batch_dedup=False).order(queue, cache, [], 0.0).order
    assert ordered[-3:] == cold and all(r.match_len == 1900 for r in ordered[:-3])
