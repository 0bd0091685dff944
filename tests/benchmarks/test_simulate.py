"""The trace simulator and the Belady bound: exact on hand-worked traces, never beaten by a policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.belady import FutureIndex
from benchmarks.simulate import DEFAULT_CACHES, future_index, main, replay
from benchmarks.traces import working_set_tokens
from benchmarks.workloads import TraceRequest, make_workload

EMPTY = np.zeros(0, dtype=np.int64)


def trace(*prompts: list[int], outputs: list[list[int]] | None = None) -> list[TraceRequest]:
    outs = outputs or [[] for _ in prompts]
    return [TraceRequest(np.asarray(p, dtype=np.int64), np.asarray(o, dtype=np.int64)) for p, o in zip(prompts, outs)]


def run(requests: list[TraceRequest], cache: str, capacity: int, concurrency: int = 1) -> tuple[int, int]:
    result = replay(requests, cache, capacity, concurrency, future_index(requests))
    return result.cached_tokens, result.evicted_tokens


def test_future_index_next_use_and_shared_tail() -> None:
    index = FutureIndex(
        [
            (None, np.array([1, 2, 3, 4])),
            (None, np.array([1, 2, 9])),
            (None, np.array([1, 2, 3, 4])),
            ("ns", np.array([1, 2])),
        ]
    )
    assert index.next_use(None, np.array([1, 2]), now=0) == (1.0, 0)  # request 1 starts with [1, 2]
    assert index.next_use(None, np.array([1, 2, 3]), now=0) == (2.0, 2)  # [3, 4] is one node: users 0, 2
    assert index.next_use(None, np.array([1, 2, 3, 4]), now=2) == (math.inf, 2)
    assert index.next_use(None, np.array([1, 2, 3, 7, 7]), now=0) == (math.inf, 3)  # no prompt goes past [1,2,3]
    assert index.next_use("ns", np.array([1, 2]), now=0) == (3.0, 0)
    assert index.next_use("other", np.array([1]), now=0) == (math.inf, 0)


def test_belady_is_exact_on_the_textbook_example() -> None:
    """A B C A B, two tokens each, room for two: MIN keeps A at C's arrival (B comes back later), LRU does not."""
    a, b, c = [1, 2], [3, 4], [5, 6]
    requests = trace(a, b, c, a, b)
    assert run(requests, "belady", 4) == (2, 4)  # hit A at t3; evict B at t2, then C (never used again) at t4
    assert run(requests, "radix-lru-p1", 4) == (0, 6)


def test_belady_trims_a_leaf_tail_that_no_one_will_read() -> None:
    """[1,2,3,4] then [7] with room for 4: MIN drops only token 4, so [1,2,3,8] reads 3 tokens."""
    requests = trace([1, 2, 3, 4], [7], [1, 2, 3, 8])
    assert run(requests, "belady", 4) == (3, 2)  # evicts token 4, then [7] for token 8
    assert run(requests, "radix-lru-p1", 4)[0] == 0  # whole-leaf eviction loses the prefix


def test_the_whether_oracle_drops_what_no_one_reads_and_otherwise_goes_by_recency() -> None:
    """``oracle-ever`` knows whether a leaf is read again, not when: A B C A keeps A (B is dead), where LRU
    drops A; in A B C A C B every block is read again, so it drops by recency as LRU does, where MIN keeps A."""
    a, b, c = [1, 2], [3, 4], [5, 6]
    assert run(trace(a, b, c, a), "oracle-ever", 4) == (2, 2)
    assert run(trace(a, b, c, a), "radix-lru-p1", 4) == (0, 4)
    every_one_again = trace(a, b, c, a, c, b)
    assert run(every_one_again, "oracle-ever", 4) == run(every_one_again, "radix-lru-p1", 4) == (2, 6)
    assert run(every_one_again, "belady", 4) == (4, 4)
    assert run(trace([1, 2, 3, 4], [7], [1, 2, 3, 8]), "oracle-ever", 4) == (3, 2)  # a dead tail trimmed as MIN's


def test_bound_equals_every_policy_when_capacity_covers_the_working_set() -> None:
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 1000, 40)
    requests = [
        TraceRequest(
            np.concatenate([shared[: rng.integers(5, 40)], rng.integers(3, 1000, 10)]), rng.integers(3, 1000, 5)
        )
        for _ in range(60)
    ]
    capacity = working_set_tokens(requests) + 64  # + room for the one in-flight request's own copy
    hits = {
        name: run(requests, name, capacity)[0] for name in DEFAULT_CACHES if "p16" not in name and name != "block-16"
    }
    bound = hits.pop("belady")
    assert hits.pop("none") == 0
    assert set(hits.values()) == {bound} and bound > 0


@st.composite
def small_traces(draw: st.DrawFn) -> tuple[list[TraceRequest], int, int]:
    num_prefixes = draw(st.integers(1, 4))
    prefixes = [draw(st.lists(st.integers(3, 40), min_size=1, max_size=24)) for _ in range(num_prefixes)]
    requests = []
    for _ in range(draw(st.integers(2, 25))):
        prefix = prefixes[draw(st.integers(0, num_prefixes - 1))]
        cut = draw(st.integers(1, len(prefix)))
        tail = draw(st.lists(st.integers(3, 40), max_size=6))
        output = draw(st.lists(st.integers(3, 40), max_size=4))
        requests.append(
            TraceRequest(np.asarray(prefix[:cut] + tail, dtype=np.int64), np.asarray(output, dtype=np.int64))
        )
    return requests, draw(st.integers(16, 120)), draw(st.integers(1, 3))


@settings(max_examples=150)
@given(small_traces())
def test_no_policy_beats_the_bound(case: tuple[list[TraceRequest], int, int]) -> None:
    requests, capacity, concurrency = case
    index = future_index(requests)
    results = {name: replay(requests, name, capacity, concurrency, index) for name in [*DEFAULT_CACHES, "oracle-ever"]}
    bound = results.pop("belady")
    for name, result in results.items():
        assert result.rejected == bound.rejected or name.endswith("p16") or name.startswith("block")
        if result.rejected == bound.rejected:
            assert result.cached_tokens <= bound.cached_tokens, (name, result, bound)


def test_simulate_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--workload",
            "rag",
            "--num-requests",
            "60",
            "--capacity-fraction",
            "0.25,1.0",
            "--concurrency",
            "4",
            "--repeat",
            "2",
            "--caches",
            "radix-lru-p1,radix-lfu-p1,radix-adaptive-p1,radix-lru-p16,block-16,none,belady",
            "--output-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert "belady (bound)" in out and "radix-lru-p16" in out and "gap to bound" in out
    assert "adaptive against the fixed policies" in out and "CPU vs lru" in out
    rows = json.loads((tmp_path / "simulate-rag.json").read_text())
    assert len(rows) == 14 and (tmp_path / "simulate-rag.png").stat().st_size > 10_000
    for capacity in {r["capacity"] for r in rows}:
        at = {r["cache"]: r for r in rows if r["capacity"] == capacity}
        assert at["none"]["hit_rate"] == 0
        assert all(r["hit_rate"] <= at["belady"]["hit_rate"] for r in at.values())


@pytest.mark.parametrize("seed", [1, 2])
def test_adaptive_keeps_up_with_lru_when_popularity_flips(seed: int) -> None:
    """rag-shift (the hot documents change halfway) at 25% of the working set: adaptive within 0.5 point of LRU.

    Issue 16's target. Learning the shift from ghost hits alone kept the stale documents: 1.5 and 2.2
    points under LRU at these seeds (BENCHMARKS §2).
    """
    requests = make_workload("rag-shift", num_requests=1000, seed=seed)
    capacity = int(0.25 * working_set_tokens(requests))
    lru, adaptive = (replay(requests, f"radix-{policy}-p1", capacity, 16).hit_rate for policy in ("lru", "adaptive"))
    assert adaptive >= lru - 0.005, (adaptive, lru)
