"""The replica simulation: cache-aware routing keeps conversations together; round-robin spreads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.replicas import ROUTERS, simulate_replicas
from benchmarks.simulate import main
from benchmarks.traces import working_set_tokens
from benchmarks.workloads import make_workload


def test_cache_aware_beats_round_robin_on_support_agent_at_8_replicas() -> None:
    requests = make_workload("support-agent", num_requests=300, seed=1)
    capacity = working_set_tokens(requests) // 10
    results = {router: simulate_replicas(requests, 8, router, capacity) for router in ROUTERS}
    assert results["cache-aware"].hit_rate > results["round-robin"].hit_rate + 0.05
    assert results["cache-aware-precise"].hit_rate >= results["cache-aware"].hit_rate - 0.01
    assert all(r.prompt_tokens == sum(len(q.prompt) for q in requests) for r in results.values())
    assert results["round-robin"].load_imbalance < 1.05  # it balances, and that is all it does
    assert results["cache-aware"].load_imbalance < 2.0  # the thresholds keep it from piling up


def test_simulate_replicas_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--workload",
            "rag",
            "--num-requests",
            "80",
            "--replicas",
            "2,4",
            "--router",
            "round-robin,cache-aware",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert "cache-aware" in capsys.readouterr().out
    rows = json.loads((tmp_path / "replicas-rag.json").read_text())
    assert {(r["replicas"], r["router"]) for r in rows} == {
        (n, r) for n in (2, 4) for r in ("round-robin", "cache-aware")
    }
    assert (tmp_path / "replicas-rag.png").stat().st_size > 10_000
