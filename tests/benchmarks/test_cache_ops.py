"""The benchmark's own logic (not its speed): workloads are seeded and the replay is honest."""

import numpy as np
import pytest

from benchmarks.cache_ops import main, measure_growth, replay
from benchmarks.workloads import TraceRequest, support_agent
from radixserve.cache.core.key import common_prefix_len


def test_support_agent_is_seeded_and_embeds_earlier_replies() -> None:
    a, b = support_agent(num_users=3, turns_per_user=3, seed=7), support_agent(num_users=3, turns_per_user=3, seed=7)
    assert len(a) == 9 and all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b))
    preamble = a[0].prompt[: 512 + 1543]
    assert all(np.array_equal(r.prompt[: len(preamble)], preamble) for r in a)
    # A later turn of some user starts with an earlier prompt plus that prompt's reply.
    assert any(
        len(later.prompt) > len(early.prompt) + len(early.output)
        and np.array_equal(
            later.prompt[: len(early.prompt) + len(early.output)], np.concatenate([early.prompt, early.output])
        )
        for i, early in enumerate(a)
        for later in a[i + 1 :]
    )


def brute_force_hit_rate(trace: list[TraceRequest], window: int = 16) -> float:
    """Unbounded cache, same in-flight window: a prompt hits its longest prefix among finished requests."""
    finished: list[np.ndarray] = []
    in_flight: list[np.ndarray] = []
    prompt_tokens = cached_tokens = 0
    for request in trace:
        if len(in_flight) == window:
            finished.append(in_flight.pop(0))
        cached_tokens += max((common_prefix_len(request.prompt, seq) for seq in finished), default=0)
        prompt_tokens += len(request.prompt)
        in_flight.append(np.concatenate([request.prompt, request.output]))
    return cached_tokens / prompt_tokens


def test_replay_hit_rate_equals_brute_force_and_orders_the_variants() -> None:
    trace = support_agent(num_users=20, turns_per_user=3)
    radix = replay("radix-p1", trace, pool_tokens=200_000)
    paged = replay("radix-p16", trace, pool_tokens=200_000)
    none = replay("none", trace, pool_tokens=200_000)
    assert radix.hit_rate == pytest.approx(brute_force_hit_rate(trace))
    assert 0.5 < radix.hit_rate
    assert none.hit_rate == 0.0
    assert radix.hit_rate - 0.01 < paged.hit_rate <= radix.hit_rate  # page 16 loses < 16 tokens per request


def test_replay_under_memory_pressure_evicts_and_stays_consistent() -> None:
    trace = support_agent(num_users=60, turns_per_user=3)  # ~90k distinct tokens in all
    tight = replay("radix-p1", trace, pool_tokens=15_000, window=4)  # replay() checks invariants at the end
    roomy = replay("radix-p1", trace, pool_tokens=400_000, window=4)
    assert tight.hit_rate < roomy.hit_rate


def test_growth_measurement_runs_for_each_variant(capsys: object) -> None:
    for variant in ("radix-p1", "radix-p16", "block-16"):
        result = measure_growth(variant, num_requests=50, repeat=3)
        assert result.match_us > 0 and result.insert_us > 0 and result.evict_us > 0


def test_cli_prints_both_tables(capsys) -> None:  # type: ignore[no-untyped-def]
    main(["--sizes", "20", "--repeat", "2", "--users", "4", "--variants", "radix-p1,none"])
    out = capsys.readouterr().out
    assert "evict 300" in out and "radix-p1" in out and "token hit rate" in out
