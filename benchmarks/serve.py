"""``radixserve bench serve``: replay a workload against a running OpenAI-compatible server.

Every request streams ``/v1/completions`` (``max_tokens`` = the trace's output
length, ``temperature=0``, ``ignore_eos``, usage in the last chunk), so the same
run can be pointed at radixserve, SGLang or vLLM (``--base-url``). Prompts go as
token ids (``--prompt-format tokens``: no tokenizer in the loop, the cache sees
exactly the trace's sharing) or as pseudo-words (``text``). Requests arrive all
at once (default), as a Poisson process (``--request-rate``), or at the trace's
own timestamps; ``--max-concurrency`` caps how many are in flight. A workload of sessions (``agent-loop``)
is a closed loop: a session's next turn is sent once its previous turn is answered, and the result
reports, per turn, the share of prompt tokens the server read from its cache (``cached_tokens``) next
to the share the turn appended to the session's previous prompt (what a cache keeping it must compute).

Per request: TTFT (send to the first chunk carrying text), the gaps between
chunks (ITL), end-to-end latency, and the usage the server reports
(``prompt_tokens_details.cached_tokens``). When the server is radixserve with
``--enable-metrics``, the hit rate is also taken from the ``/metrics`` counter
deltas, and the prompt tokens actually computed from ``/server_info``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.traces import load_trace, text_of, with_poisson_arrivals
from benchmarks.workloads import VOCAB_SIZE, WORKLOADS, TraceRequest, make_workload

COUNTERS = ("prompt_tokens", "cached_tokens", "generation_tokens")  # radixserve:<name>_total


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @staticmethod
    def of(seconds: list[float]) -> LatencyStats:
        if not seconds:
            return LatencyStats(math.nan, math.nan, math.nan, math.nan)
        ms = np.asarray(seconds) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
        return LatencyStats(float(ms.mean()), p50, p90, p99)


@dataclass
class RequestRecord:
    prompt_len: int  # tokens in the trace's prompt
    output_len: int  # tokens asked for (max_tokens)
    success: bool = False
    error: str | None = None
    start_s: float = 0.0  # when it was sent, from the benchmark's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's usage (0 when it sent none)
    completion_tokens: int = 0
    cached_tokens: int = 0
    turn: int | None = None  # its turn in its session (closed-loop workloads)
    appended_tokens: int = 0  # prompt tokens its session's previous turn's prompt lacks (all, on a first turn)
    text: str = ""  # the answer, as streamed


@dataclass(frozen=True)
class TurnStats:
    """One turn of every session: how much of its prompts the cache served."""

    turn: int
    completed: int
    mean_prompt_tokens: float
    cached_share: float  # sum cached / sum prompt tokens (the server's usage)
    appended_share: float  # sum appended / sum prompt tokens: at best, only this is computed

    @staticmethod
    def of(records: list[RequestRecord]) -> list[TurnStats]:
        turns = sorted({r.turn for r in records if r.turn is not None and r.success})
        out = []
        for turn in turns:
            done = [r for r in records if r.turn == turn and r.success]
            prompt = sum(r.prompt_tokens for r in done) or 1
            share = sum(r.cached_tokens for r in done) / prompt
            appended = sum(r.appended_tokens for r in done) / prompt
            out.append(TurnStats(turn, len(done), prompt / len(done), share, appended))
        return out


@dataclass(frozen=True)
class BenchResult:
    base_url: str
    model: str
    prompt_format: str
    request_rate: float
    max_concurrency: int | None
    duration_s: float
    completed: int
    failed: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # completion tokens / s
    total_prompt_tokens: int
    total_completion_tokens: int
    total_cached_tokens: int
    cache_hit_rate: float  # from usage: sum cached / sum prompt tokens
    ttft: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    metrics_hit_rate: float | None = None  # from the /metrics counter deltas (radixserve only)
    metrics_prompt_tokens: int | None = None
    metrics_cached_tokens: int | None = None
    metrics_generation_tokens: int | None = None
    prefill_tokens: int | None = None  # /server_info scheduler.prefill_tokens delta: prompt tokens computed
    errors: list[str] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    per_turn: list[TurnStats] = field(default_factory=list)  # closed-loop (session) workloads only

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_safe(v) for k, v in dataclasses.asdict(self).items()}

    def table(self) -> str:
        def optional(value: float | None, fmt: str) -> str:
            return "n/a" if value is None else format(value, fmt)

        cap = self.max_concurrency or "none"
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s (Poisson)"
        lines = [
            f"{' Serving benchmark ':=^64}",
            f"{'Server / model':<40}{self.base_url} / {self.model}",
            f"{'Prompts / arrivals / concurrency cap':<40}{self.prompt_format} / {rate} / {cap}",
            f"{'Completed / failed requests':<40}{self.completed} / {self.failed}",
            f"{'Duration (s)':<40}{self.duration_s:.2f}",
            f"{'Request throughput (req/s)':<40}{self.request_throughput:.2f}",
            f"{'Input token throughput (tok/s)':<40}{self.input_throughput:.1f}",
            f"{'Output token throughput (tok/s)':<40}{self.output_throughput:.1f}",
            f"{'Prompt / cached / completion tokens':<40}{self.total_prompt_tokens:,} / "
            f"{self.total_cached_tokens:,} / {self.total_completion_tokens:,}",
            f"{'Cache hit rate (usage)':<40}{self.cache_hit_rate:.1%}",
            f"{'Cache hit rate (/metrics counters)':<40}{optional(self.metrics_hit_rate, '.1%')}",
            f"{'Prompt tokens computed (/server_info)':<40}{optional(self.prefill_tokens, ',')}",
            f"{' Latency (ms) ':-^64}",
            f"{'':<8}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}",
        ]
        for name, stats in (("TTFT", self.ttft), ("ITL", self.itl), ("E2E", self.e2e)):
            figures = (stats.mean_ms, stats.p50_ms, stats.p90_ms, stats.p99_ms)
            lines.append(f"{name:<8}" + "".join(f"{v:>12.1f}" for v in figures))
        if self.per_turn:
            lines.append(f"{' Per turn (sessions) ':-^64}")
            lines.append(f"{'turn':<8}{'done':>8}{'prompt tok':>14}{'cached share':>16}{'appended share':>18}")
            for t in self.per_turn:
                shares = f"{t.cached_share:>16.1%}{t.appended_share:>18.1%}"
                lines.append(f"{t.turn:<8}{t.completed:>8}{t.mean_prompt_tokens:>14.0f}{shares}")
        lines.extend(f"error: {message}" for message in self.errors[:5])
        lines.append("=" * 64)
        return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """Standard JSON: NaN (no data) becomes null, infinity (no rate limit) the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


# ---- talking to the server ---------------------------------------------------------------------


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def server_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, int]:
    """radixserve's own figures, where the server has them: /metrics counters, /server_info prefill."""
    found: dict[str, int] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        response = await client.get(base_url + "/metrics")
        if response.status_code == 200:
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    name = sample.name.removeprefix("radixserve:").removesuffix("_total")
                    if sample.name.startswith("radixserve:") and sample.name.endswith("_total") and name in COUNTERS:
                        found[name] = found.get(name, 0) + int(sample.value)  # summed over replicas
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        response = await client.get(base_url + "/server_info")
        if response.status_code == 200:
            info = response.json()
            servers = info["replicas"].values() if "replicas" in info else [info]  # radixserve's replica front
            found["prefill_tokens"] = sum(int(server["scheduler"]["prefill_tokens"]) for server in servers)
    return found


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:300]
    return f"HTTP {status}: {message}"


def _chunk_text(choice: dict[str, Any]) -> str:
    """A streamed choice's new text: a completion's ``text``, a chat completion's ``delta.content``."""
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, t0: float
) -> None:
    """Stream one completion into ``record``; every failure is recorded, none raised."""
    start = time.perf_counter()
    record.start_s = start - t0
    last_token = start
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = _error_message(response.status_code, await response.aread())
                return
            chunks_with_text, done = 0, False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("error") or event.get("object") == "error":  # ours / SGLang; vLLM
                    error = event.get("error") or event
                    record.error = str(error.get("message", error) if isinstance(error, dict) else error)
                    return
                now = time.perf_counter()
                text = "".join(_chunk_text(choice) for choice in event.get("choices") or [])
                if text:
                    record.text += text
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last_token)
                    last_token = now
                    chunks_with_text += 1
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    record.completion_tokens = int(usage.get("completion_tokens") or 0)
                    record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if not done:
                record.error = "the stream ended without [DONE]"
                return
            if not record.completion_tokens:  # a server that sent no usage: count chunks
                record.completion_tokens = chunks_with_text
            record.e2e_s = time.perf_counter() - start
            record.success = True
    except Exception as exc:  # a broken connection or a malformed event: this request failed, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"


# ---- the run -------------------------------------------------------------------------------------


def arrival_offsets(
    requests: list[TraceRequest], request_rate: float, use_trace_timestamps: bool, seed: int
) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if use_trace_timestamps:
        if any(r.timestamp is None for r in requests):
            raise ValueError("use_trace_timestamps: some requests have no timestamp")
        stamps = [float(r.timestamp or 0.0) for r in requests]
        first = min(stamps, default=0.0)
        return [s - first for s in stamps]
    if math.isinf(request_rate):
        return [0.0] * len(requests)
    timed = with_poisson_arrivals(requests, request_rate, seed=seed)
    first = min(float(r.timestamp or 0.0) for r in timed)
    return [float(r.timestamp or 0.0) - first for r in timed]


def session_chains(requests: list[TraceRequest]) -> tuple[list[int], dict[int, int]]:
    """The requests sent at their arrival times (first turns, and requests of no session), and each session
    turn's next turn (sent once it is answered)."""
    sessions: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        if request.session is not None:
            sessions.setdefault(request.session, []).append(i)
    after: dict[int, int] = {}
    for chain in sessions.values():
        chain.sort(key=lambda i: requests[i].turn)
        after.update(zip(chain, chain[1:]))
    later = set(after.values())
    return [i for i in range(len(requests)) if i not in later], after


def make_records(requests: list[TraceRequest], after: dict[int, int]) -> list[RequestRecord]:
    records = [RequestRecord(len(r.prompt), max(1, len(r.output))) for r in requests]
    for i, request in enumerate(requests):
        if request.session is not None:
            records[i].turn, records[i].appended_tokens = request.turn, len(request.prompt)
    for i, j in after.items():
        records[j].appended_tokens = len(requests[j].prompt) - len(requests[i].prompt)
    return records


def request_body(model: str, request: TraceRequest, prompt_format: str) -> dict[str, Any]:
    if prompt_format not in ("tokens", "text"):
        raise ValueError(f"prompt_format must be 'tokens' or 'text', not {prompt_format!r}")
    prompt: Any = request.prompt.tolist() if prompt_format == "tokens" else text_of(request.prompt)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max(1, len(request.output)),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.extra_key is not None:  # the request's cache namespace (radixserve, vLLM: cache_salt)
        body["cache_salt"] = request.extra_key
    return body


async def run_benchmark(
    base_url: str,
    requests: list[TraceRequest],
    *,
    model: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    prompt_format: str = "tokens",
    use_trace_timestamps: bool = False,
    progress: bool = True,
    seed: int = 0,
    api_key: str | None = None,
    timeout: float = 3600.0,
) -> BenchResult:
    """Send ``requests`` to ``base_url`` and measure; failed requests are counted, never raised."""
    base_url = base_url.rstrip("/")
    offsets = arrival_offsets(requests, request_rate, use_trace_timestamps, seed)
    firsts, next_turn = session_chains(requests)
    records = make_records(requests, next_turn)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits, headers=headers)
    async with client:
        model_id = model or await first_model_id(client, base_url)
        before = await server_counters(client, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = progress_bar(len(requests), progress)
        url = base_url + "/v1/completions"
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            async with gate or contextlib.nullcontext():
                await send_request(client, url, request_body(model_id, requests[i], prompt_format), records[i], t0)
            bar.update(1)
            if i in next_turn:  # the session's next turn: once this one is answered
                await one(next_turn[i])

        tasks = []
        for i in sorted(firsts, key=lambda i: offsets[i]):
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        after = await server_counters(client, base_url)
    delta = {k: after[k] - before[k] for k in after if k in before}
    return summarize(
        records,
        duration,
        delta,
        base_url=base_url,
        model=model_id,
        prompt_format=prompt_format,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
    )


def summarize(records: list[RequestRecord], duration: float, delta: dict[str, int], **settings: Any) -> BenchResult:
    done = [r for r in records if r.success]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    metrics_prompt = delta.get("prompt_tokens")
    metrics_cached = delta.get("cached_tokens")
    metrics_hit = metrics_cached / metrics_prompt if metrics_prompt and metrics_cached is not None else None
    per_second = 1.0 / duration if duration > 0 else 0.0
    return BenchResult(
        **settings,
        duration_s=duration,
        completed=len(done),
        failed=len(records) - len(done),
        request_throughput=len(done) * per_second,
        input_throughput=prompt * per_second,
        output_throughput=completion * per_second,
        total_prompt_tokens=prompt,
        total_completion_tokens=completion,
        total_cached_tokens=cached,
        cache_hit_rate=cached / prompt if prompt else 0.0,
        ttft=LatencyStats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        itl=LatencyStats.of([gap for r in done for gap in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s for r in done if r.e2e_s is not None]),
        metrics_hit_rate=metrics_hit,
        metrics_prompt_tokens=metrics_prompt,
        metrics_cached_tokens=metrics_cached,
        metrics_generation_tokens=delta.get("generation_tokens"),
        prefill_tokens=delta.get("prefill_tokens"),
        errors=[r.error for r in records if r.error is not None],
        records=records,
        per_turn=TurnStats.of(records),
    )


# ---- the command ---------------------------------------------------------------------------------


def server_vocab_size(base_url: str, api_key: str | None) -> int | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/server_info", headers=headers, timeout=30)
        if response.status_code != 200:
            return None
        info = response.json()
        if "replicas" in info:  # radixserve's replica front: every replica serves the same model
            info = next(iter(info["replicas"].values()))
        return int(info["engine"]["vocab_size"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="radixserve bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (OpenAI-compatible)")
    parser.add_argument("--model", default=None, help="default: the first id from /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--workload",
        default=None,
        help=f"one of {', '.join(sorted(WORKLOADS))} (default support-agent); with --servers, copy workloads "
        "(comma-separated: code-edit,rag-quote,agent,prose; default all)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="default: the workload's own size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=None, help="replay a trace file instead (load_trace)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"token ids stay below it (default: /server_info's, else {VOCAB_SIZE})",
    )
    parser.add_argument("--prompt-format", default="tokens", choices=["tokens", "text"])
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--use-trace-timestamps", action="store_true", help="send at the trace's own times")
    parser.add_argument("--output", type=Path, default=None, help="write the results + per-request records as JSON")
    side = parser.add_argument_group("side by side (copy workloads through several servers; serve_speculative.py)")
    side.add_argument("--servers", nargs="+", default=None, metavar="NAME=URL", help="e.g. off=URL ngram=URL")
    side.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    side.add_argument("--rounds", type=int, default=3)
    side.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.servers:
        from benchmarks import serve_speculative  # it imports this module's client

        serve_speculative.main(args)
        return
    if args.workload is None:
        args.workload = "support-agent"
    if args.workload not in WORKLOADS:
        parser.error(f"--workload: choose from {sorted(WORKLOADS)}")

    vocab = args.vocab_size or server_vocab_size(args.base_url, args.api_key) or VOCAB_SIZE
    if args.trace is not None:
        requests = load_trace(args.trace, vocab_size=vocab, limit=args.num_requests)
    else:
        requests = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed, vocab_size=vocab)
    result = asyncio.run(
        run_benchmark(
            args.base_url,
            requests,
            model=args.model,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            prompt_format=args.prompt_format,
            use_trace_timestamps=args.use_trace_timestamps,
            seed=args.seed,
            api_key=args.api_key,
        )
    )
    print(result.table())
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result.to_dict(), indent=1))
        print(f"wrote {args.output}")


class _Progress(Protocol):
    def update(self, n: int = 1) -> object: ...
    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: int = 1) -> object:
        return None

    def close(self) -> None:
        return None


def progress_bar(total: int, enabled: bool) -> _Progress:
    """tqdm's bar on stderr; none when not wanted or when the [bench] extra (tqdm) is missing."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return _NoProgress()
    bar: _Progress = tqdm(total=total, file=sys.stderr, desc="requests")
    return bar
