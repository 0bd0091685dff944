"""Randomised workload families: each seed is its own workload, the same on every run."""

from __future__ import annotations

import pytest

from benchmarks.families import FAMILIES, HELD_OUT_SEEDS, TUNING_SEEDS, draw


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_seed_draws_the_same_workload_and_seeds_differ(family: str) -> None:
    params, requests = draw(family, 5)
    again_params, again = draw(family, 5)
    assert params == again_params and len(requests) == len(again) > 0
    assert all((a.prompt == b.prompt).all() and a.timestamp == b.timestamp for a, b in zip(requests, again))
    others = [draw(family, seed)[0] for seed in (6, 7, 8)]
    assert any(p != params for p in others), "the parameters must vary with the seed"
    times = [r.timestamp for r in requests]
    assert times == sorted(times) and times[0] == 0.0  # Poisson arrivals: the replay's clock


def test_tuning_and_held_out_seeds_are_disjoint() -> None:
    assert not set(TUNING_SEEDS) & set(HELD_OUT_SEEDS) and len(HELD_OUT_SEEDS) >= 20
    with pytest.raises(ValueError, match="unknown family"):
        draw("nope", 0)
