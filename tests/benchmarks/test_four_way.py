"""``radixserve bench four-way --tiny``: four real servers, one workload, the counts each must compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.four_way import RUNS, main

GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 3, 3, 128, 16, 4


def test_tiny_four_way_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--tiny",
            "--num-groups",
            str(GROUPS),
            "--prompts-per-group",
            str(PER_GROUP),
            "--system-prompt-len",
            str(SYSTEM_LEN),
            "--question-len",
            str(QUESTION_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            "--max-total-tokens",
            "4096",
            "--output-dir",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    table = printed[printed.index("run ") :]
    assert all(f"\n{name} " in table for name in RUNS)

    report = json.loads((tmp_path / "four-way.json").read_text())
    runs = report["runs"]
    assert list(runs) == list(RUNS) and report["workload"]["num_groups"] == GROUPS
    num_requests = GROUPS * PER_GROUP
    all_prompt_tokens = num_requests * (SYSTEM_LEN + QUESTION_LEN)
    for name, run in runs.items():
        assert (run["completed"], run["failed"]) == (num_requests, 0), name
        assert run["total_prompt_tokens"] == all_prompt_tokens
        assert run["total_completion_tokens"] == num_requests * OUTPUT_LEN
        assert run["metrics_hit_rate"] == run["cache_hit_rate"]
    # The control computes every prompt token; the cache computes each group's preamble once
    # (the preamble is page-aligned, so page 16 loses nothing here).
    assert runs["no-cache"]["cache_hit_rate"] == 0.0
    assert runs["no-cache"]["prefill_tokens"] == all_prompt_tokens
    for name in ("baseline", "lpm+slru", "page16"):
        assert runs[name]["prefill_tokens"] == GROUPS * SYSTEM_LEN + num_requests * QUESTION_LEN, name
    assert runs["baseline"]["cache_hit_rate"] > 0.5
    assert runs["lpm+slru"]["flags"] == list(RUNS["lpm+slru"]) + ["--max-total-tokens", "4096"]
    assert (tmp_path / "four-way.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_run_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--tiny", "--runs", "baseline,lru-only", "--output-dir", str(tmp_path)])
