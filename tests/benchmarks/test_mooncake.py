"""Mooncake's production traces in the simulator: the scaled loader, time slices, the trace clock.

The slices beside this file are the first lines of Mooncake's FAST'25 traces (kvcache-ai/Mooncake,
FAST25-release/traces/): conversation (200 lines) and synthetic (120 lines).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.simulate import main
from benchmarks.traces import load_scaled_trace, time_slice

DATA = Path(__file__).parent / "data"
CONVERSATION = DATA / "mooncake_conversation_head200.jsonl"
SYNTHETIC = DATA / "mooncake_synthetic_head120.jsonl"


def test_scaled_blocks_keep_the_sharing_and_scale_every_length() -> None:
    lines = [json.loads(line) for line in CONVERSATION.read_text().splitlines()]
    requests = load_scaled_trace(CONVERSATION, block_tokens=32)
    assert len(requests) == len(lines) == 200
    for line, request in zip(lines, requests):
        assert len(request.prompt) == -(-line["input_length"] * 32 // 512) and len(request.output) == 0
        assert request.timestamp == pytest.approx(line["timestamp"] / 1000)
    # Equal hash ids are equal 32-token blocks, different ones differ.
    first, second = lines[0]["hash_ids"], lines[1]["hash_ids"]
    assert first[0] == second[0] and first[1] != second[1]
    assert np.array_equal(requests[0].prompt[:32], requests[1].prompt[:32])
    assert not np.array_equal(requests[0].prompt[32:64], requests[1].prompt[32:64])


def test_time_halves_split_at_the_midpoint_of_the_span() -> None:
    requests = load_scaled_trace(SYNTHETIC)
    first, second = time_slice(requests, "first-half"), time_slice(requests, "second-half")
    assert len(first) + len(second) == len(requests) and first and second
    middle = (requests[0].timestamp + requests[-1].timestamp) / 2  # type: ignore[operator]
    assert max(r.timestamp for r in first) < middle <= min(r.timestamp for r in second)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="time slice"):
        time_slice(requests, "third-half")


def test_simulate_reads_a_mooncake_half(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--trace",
            f"mooncake:{SYNTHETIC}",
            "--num-requests",
            "0",
            "--time-slice",
            "second-half",
            "--block-tokens",
            "16",
            "--caches",
            "radix-lru-p1,belady",
            "--capacity-fraction",
            "0.1",
            "--output-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "simulate-mooncake_synthetic_head120.jsonl-second-half.json").read_text())
    half = len(time_slice(load_scaled_trace(SYNTHETIC), "second-half"))
    assert {r["cache"] for r in rows} == {"radix-lru-p1", "belady"} and all(r["requests"] == half for r in rows)
    assert f"{half:,} requests" in out


def test_policy_table_command_on_a_trace_half_and_a_family(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.eviction_heldout import main as policy_table

    policy_table(
        [
            "--traces",
            f"mooncake:{SYNTHETIC}",
            "--fractions",
            "0.25",
            "--families",
            "chat",
            "--seeds",
            "3,4",
            "--family-fractions",
            "0.25",
        ]
    )
    out = capsys.readouterr().out
    trace_row = next(line for line in out.splitlines() if line.startswith("mooncake_synthetic_head120"))
    assert "learned" in trace_row and "adaptive" in trace_row and "µs" in trace_row
    family_row = next(line for line in out.splitlines() if line.startswith("chat"))
    assert "learned worst" in family_row and ("seed 3" in family_row or "seed 4" in family_row)


def test_a_trace_replay_runs_on_the_trace_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online caches read the trace's timestamps (time-aware policies see real gaps); Belady the request index."""
    import benchmarks.simulate as simulate

    made = []

    def spy(*args: object) -> object:
        made.append(make(*args))  # type: ignore[arg-type]
        return made[-1]

    make = simulate.make_cache
    monkeypatch.setattr(simulate, "make_cache", spy)
    requests = load_scaled_trace(SYNTHETIC)[:40]
    assert len({r.timestamp for r in requests}) > 1
    simulate.replay(requests, "radix-learned-p1", 4000, trace_clock=True)
    simulate.replay(requests, "radix-lru-p1", 4000)
    simulate.replay(requests, "belady", 4000, index=simulate.future_index(requests), trace_clock=True)
    assert made[0].clock() == pytest.approx(requests[-1].timestamp)  # type: ignore[attr-defined]
    assert made[1].clock() == made[2].clock() == len(requests) - 1  # type: ignore[attr-defined]
