"""``radixserve bench serve`` against a real tiny-model server: the figures it reports are the server's own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.copy_workloads import Workload
from benchmarks.serve import BenchResult, LatencyStats, main, run_benchmark
from benchmarks.serve_speculative import format_table, side_by_side
from benchmarks.traces import save_trace
from benchmarks.workloads import TraceRequest, agent_loop, generated_shared_prefix
from tests.support.server_process import ServerProcess

GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 4, 5, 96, 16, 8


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:  # 256-token context
    with ServerProcess(
        "--enable-metrics", "--max-total-tokens", "8192", "--log-level", "warning", model_path=tiny_model_dir
    ) as proc:
        yield proc


def workload(url: str, seed: int = 0) -> list[TraceRequest]:
    vocab = int(httpx.get(url + "/server_info", timeout=30).json()["engine"]["vocab_size"])
    return generated_shared_prefix(GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN, seed=seed, vocab_size=vocab)


def run(url: str, requests: list[TraceRequest], **kwargs: object) -> BenchResult:
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200  # every run starts cold
    return asyncio.run(run_benchmark(url, requests, progress=False, **kwargs))  # type: ignore[arg-type]


def assert_ordered(stats: LatencyStats) -> None:
    assert 0 <= stats.p50_ms <= stats.p90_ms <= stats.p99_ms and stats.mean_ms > 0


@pytest.mark.parametrize("max_concurrency", [None, 1])
def test_figures_match_the_requests_and_the_servers_counters(
    server: ServerProcess, max_concurrency: int | None
) -> None:
    requests = workload(server.url)
    result = run(server.url, requests, max_concurrency=max_concurrency)
    assert (result.completed, result.failed, result.errors) == (len(requests), 0, [])
    assert result.model == "tiny-llama"
    assert result.total_completion_tokens == sum(len(r.output) for r in requests) == len(requests) * OUTPUT_LEN
    assert result.total_prompt_tokens == sum(len(r.prompt) for r in requests)
    # Each group's first request computes the preamble, the other prompts of the group read it
    # (sequentially, or held back by in-batch dedup when all arrive at once).
    assert result.total_cached_tokens == GROUPS * (PER_GROUP - 1) * SYSTEM_LEN
    assert result.cache_hit_rate == pytest.approx(result.total_cached_tokens / result.total_prompt_tokens)
    assert result.metrics_hit_rate == result.cache_hit_rate > 0
    assert (result.metrics_prompt_tokens, result.metrics_cached_tokens, result.metrics_generation_tokens) == (
        result.total_prompt_tokens,
        result.total_cached_tokens,
        result.total_completion_tokens,
    )
    assert result.prefill_tokens == result.total_prompt_tokens - result.total_cached_tokens
    for stats in (result.ttft, result.itl, result.e2e):
        assert_ordered(stats)
    assert result.ttft.p99_ms <= result.e2e.p99_ms
    # A gap per chunk after the first; a chunk may carry more than one token (steps that reach the client together).
    assert all(0 < len(r.itl_s) <= OUTPUT_LEN - 1 for r in result.records)
    assert result.output_throughput == pytest.approx(result.total_completion_tokens / result.duration_s)
    if max_concurrency == 1:  # one at a time: each request is sent after the previous one finished
        spans = sorted((r.start_s, r.start_s + (r.e2e_s or 0.0)) for r in result.records)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))


def test_a_failing_request_is_counted_not_raised(server: ServerProcess) -> None:
    good = workload(server.url, seed=1)[:3]
    too_long = TraceRequest(np.full(300, 5, dtype=np.int64), np.zeros(4, dtype=np.int64))  # context: 256
    result = run(server.url, [good[0], too_long, *good[1:]])
    assert (result.completed, result.failed) == (3, 1)
    assert len(result.errors) == 1 and "HTTP 400" in result.errors[0] and "256" in result.errors[0]
    assert result.records[1].error == result.errors[0] and not result.records[1].success
    assert result.total_prompt_tokens == sum(len(r.prompt) for r in good)
    assert result.metrics_prompt_tokens == result.total_prompt_tokens  # the rejected one changed nothing


def test_a_dead_server_fails_every_request(tmp_path: Path) -> None:
    requests = workload_offline()[:2]
    result = asyncio.run(run_benchmark("http://127.0.0.1:9", requests, model="m", progress=False))
    assert (result.completed, result.failed) == (0, 2) and result.metrics_hit_rate is None
    assert result.prefill_tokens is None and json.dumps(result.to_dict())  # NaN latencies become null


def workload_offline() -> list[TraceRequest]:
    return generated_shared_prefix(2, 2, 8, 4, 2, vocab_size=128)


def test_cli_replays_a_trace_at_its_timestamps_and_writes_json(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [TraceRequest(r.prompt, r.output, timestamp=0.1 * i) for i, r in enumerate(workload(server.url)[:6])]
    save_trace(requests, tmp_path / "trace.jsonl")
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    out = tmp_path / "out" / "result.json"
    main(
        [
            "--base-url",
            server.url,
            "--trace",
            str(tmp_path / "trace.jsonl"),
            "--use-trace-timestamps",
            "--max-concurrency",
            "2",
            "--output",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "Serving benchmark" in printed and "TTFT" in printed and "Cache hit rate (/metrics counters)" in printed
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0 and report["max_concurrency"] == 2
    assert report["request_rate"] == "inf" and report["metrics_hit_rate"] == report["cache_hit_rate"]
    starts = sorted(r["start_s"] for r in report["records"])
    assert len(report["records"]) == 6 and starts[-1] >= 0.5  # sent at the trace's times, not all at once
    assert report["total_completion_tokens"] == sum(len(r.output) for r in requests)


def test_agent_loop_is_a_closed_loop_whose_later_turns_prefill_only_what_they_append(server: ServerProcess) -> None:
    vocab = int(httpx.get(server.url + "/server_info", timeout=30).json()["engine"]["vocab_size"])
    agents, turns, preamble = 3, 4, 24 + 40
    requests = agent_loop(
        agents, turns, 24, 40, task_len=(5, 8), call_len=(4, 6), result_len=(10, 20), seed=2, vocab_size=vocab
    )
    result = run(server.url, requests)
    assert (result.completed, result.failed) == (agents * turns, 0)
    assert [t.turn for t in result.per_turn] == list(range(turns)) and all(
        t.completed == agents for t in result.per_turn
    )
    # Turn 0: the agents share the system prompt and the tools; later turns read the whole previous prompt back.
    first = [r for r in result.records if r.turn == 0]
    assert sum(r.cached_tokens for r in first) == (agents - 1) * preamble
    for record in result.records:
        if record.turn:
            assert record.cached_tokens == record.prompt_tokens - record.appended_tokens > preamble
    assert all(t.cached_share == pytest.approx(1 - t.appended_share) for t in result.per_turn[1:])
    # Closed loop: a session's turn is sent after its previous turn ended.
    for agent in range(agents):
        chain = [rec for req, rec in zip(requests, result.records) if req.session == agent]
        assert all(a.start_s + (a.e2e_s or 0) <= b.start_s for a, b in zip(chain, chain[1:]))
    assert "Per turn (sessions)" in result.table()


def test_side_by_side_sends_each_chat_workload_to_every_server_in_turn(server: ServerProcess) -> None:
    # The same server under two names: greedy answers agree, no drafts (speculation off), every pass measured.
    prompts = [[{"role": "user", "content": word}] for word in ("hello there", "good morning", "bye")]
    work: dict[str, tuple[Workload, str | None]] = {"words": (prompts, None)}
    table = side_by_side({"a": server.url, "a-b": server.url}, work, [1, 2], rounds=2, max_tokens=6)
    assert sorted(table) == [("words", 1), ("words", 2)]
    for (_, concurrency), by_server in table.items():
        assert sorted(by_server) == ["a", "a-b"]
        for results in by_server.values():
            assert len(results) == 2  # one pass a round
            assert all(r.errors == () and r.speed > 0 and (r.drafted, r.accepted) == (0, 0) for r in results)
            assert all(len(r.texts) == (3 if concurrency == 1 else 2) and all(r.texts) for r in results)
        assert [r.texts for r in by_server["a"]] == [r.texts for r in by_server["a-b"]]
    lines = format_table(table, ["a", "a-b"]).splitlines()
    assert lines[0].startswith("| workload | conc | a tok/s | a-b tok/s | a-b / a |")
    assert lines[2].startswith("| words | 1 |") and lines[2].endswith("| - | a-b 0 |")
