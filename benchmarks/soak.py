"""``radixserve bench soak``: sustained mixed load on a loopback server, then a check that nothing leaked.

Sends ``--requests`` requests, ``--concurrency`` in flight, none new after
``--duration`` s: normal completions, chats and native generations (streamed or
not, most sharing a prefix so the cache is used, some distinct), streams the
client drops after a few chunks (``--disconnect-fraction``), requests it cancels
as they start (``--abort-fraction``) and malformed ones that must get a 4xx
(``--bad-fraction``). With ``--huge-body-clients`` / ``--slow-loris-clients``, abusive
clients run alongside and a probe times small requests (``soak_abuse``): their TTFT p99
must stay under ``--max-small-ttft``. Then it waits for the server to go idle and checks:

- every request sent has one outcome and none is unexpected (a 5xx, a broken
  connection, a 4xx to a well-formed request, a 2xx to a malformed one);
- ``radixserve:requests_total`` grew by the number of requests the server accepted;
- /cache: no lock held, no slot held by a request, free + cached == pool, invariants ok;
- the server's RSS at the end is within max(+25 %, +64 MiB) of its RSS after warm-up
  (the first 10 % of requests).

Any failed check: exit status 1. Without ``--base-url`` it starts a server (a tiny
random model with a 4k context unless ``--model-path``) with ``--max-total-tokens
8192``, so the pool is under pressure: eviction and retraction happen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.soak_abuse import AbuseLog, start_abuse
from benchmarks.soak_plan import ServerFacts, SoakCall, plan_calls
from tests.support.server_process import ServerProcess
from tests.support.tiny_model import build_engine_folder

MiB = 1 << 20
RSS_GROWTH_FRACTION, RSS_GROWTH_BYTES = 0.25, 64 * MiB
OUTCOMES = ("completed", "disconnected", "aborted", "bad_rejected", "overloaded", "unexpected")
Outcome = Literal["completed", "disconnected", "aborted", "bad_rejected", "overloaded", "unexpected"]
# Did the server take the request in (so that it counts in requests_total when it finishes)?
# "maybe": a client timeout can fire before or after the server read the request.
Accepted = Literal["yes", "no", "maybe"]


@dataclass(frozen=True)
class CallResult:
    outcome: Outcome
    accepted: Accepted
    detail: str = ""
    num_requests: int = 1  # the call's


@dataclass(frozen=True)
class OutcomeCounts:
    sent: int
    completed: int = 0
    disconnected: int = 0
    aborted: int = 0
    bad_rejected: int = 0
    overloaded: int = 0  # 503: a legitimate refusal under load
    unexpected: int = 0
    accepted_min: int = 0  # engine requests the server surely accepted
    accepted_max: int = 0  # ... and those it may have (a timeout or a 503 raced with it)
    unexpected_details: tuple[str, ...] = ()  # distinct ones, "N x detail"

    @staticmethod
    def of(sent: int, results: list[CallResult]) -> OutcomeCounts:
        outcomes: Counter[str] = Counter(r.outcome for r in results)
        accepted: Counter[str] = Counter()
        for r in results:
            accepted[r.accepted] += r.num_requests
        details = Counter(r.detail for r in results if r.outcome == "unexpected")
        return OutcomeCounts(
            sent,
            **{name: outcomes[name] for name in OUTCOMES},
            accepted_min=accepted["yes"],
            accepted_max=accepted["yes"] + accepted["maybe"],
            unexpected_details=tuple(f"{n} x {d}" for d, n in details.most_common()),
        )


# ---- the checks: pure functions of what was measured ----------------------------------------------


def check_outcomes(counts: OutcomeCounts, server_finished: int | None) -> list[str]:
    """Every request sent has an outcome, none unexpected; the server finished what it accepted."""
    problems = []
    total = sum(getattr(counts, name) for name in OUTCOMES)
    if total != counts.sent:
        problems.append(f"{counts.sent} requests sent but {total} outcomes recorded")
    if counts.unexpected:
        problems.append(f"{counts.unexpected} unexpected results: " + "; ".join(counts.unexpected_details[:5]))
    if server_finished is None:
        problems.append("no radixserve:requests_total from /metrics (start the server with --enable-metrics)")
    elif not counts.accepted_min <= server_finished <= counts.accepted_max:
        expected = (
            f"{counts.accepted_min}"
            if counts.accepted_min == counts.accepted_max
            else f"{counts.accepted_min}..{counts.accepted_max}"
        )
        problems.append(f"requests_total grew by {server_finished}, but the server accepted {expected} requests")
    return problems


def check_leaks(cache: Mapping[str, Any] | None, rss_warm_bytes: int | None, rss_end_bytes: int | None) -> list[str]:
    """On an idle server: no request, no lock, no held slot, a sound tree, and no RSS growth."""
    if cache is None:
        return ["/cache did not answer"]
    problems = []
    if cache.get("running_requests") or cache.get("waiting_requests"):
        problems.append(
            f"server not idle: {cache.get('running_requests')} running, {cache.get('waiting_requests')} waiting"
        )
    if cache.get("protected_tokens") != 0:
        problems.append(f"protected_tokens = {cache.get('protected_tokens')}: a lock is still held")
    if cache.get("live_request_tokens") != 0:
        problems.append(f"live_request_tokens = {cache.get('live_request_tokens')}: slots held with no request")
    pool, free, cached = (cache.get(k) for k in ("pool_tokens", "free_tokens", "cached_tokens"))
    if not (isinstance(pool, int) and isinstance(free, int) and isinstance(cached, int)) or free + cached != pool:
        problems.append(f"slots not conserved: free {free} + cached {cached} != pool {pool}")
    if cache.get("invariants") != "ok":
        problems.append(f"cache invariants: {cache.get('invariants')}")
    if rss_warm_bytes and rss_end_bytes:
        limit = rss_warm_bytes + max(RSS_GROWTH_FRACTION * rss_warm_bytes, RSS_GROWTH_BYTES)
        if rss_end_bytes > limit:
            problems.append(
                f"RSS grew from {rss_warm_bytes / MiB:.0f} MiB after warm-up to "
                f"{rss_end_bytes / MiB:.0f} MiB at the end (limit {limit / MiB:.0f} MiB)"
            )
    return problems


# ---- sending one request --------------------------------------------------------------------------


def refused(call: SoakCall, status: int, body: bytes) -> CallResult:
    """The outcome of a non-200 answer."""
    if status == 503:
        return CallResult("overloaded", "maybe")  # it may have been counted if refused after submission
    if call.kind == "bad" and 400 <= status < 500:
        return CallResult("bad_rejected", "no")
    try:
        message = str(json.loads(body)["error"]["message"])[:160]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:160]
    return CallResult("unexpected", "maybe", f"{call.label}: HTTP {status}: {message}")


async def send_call(client: httpx.AsyncClient, base_url: str, call: SoakCall) -> CallResult:
    """Send ``call`` and classify what happened; never raises."""
    content = call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
    timeout = httpx.USE_CLIENT_DEFAULT if call.client_timeout_s is None else httpx.Timeout(call.client_timeout_s)
    request = client.build_request(
        "POST", base_url + call.path, content=content, timeout=timeout, headers={"content-type": "application/json"}
    )
    try:
        response = await client.send(request, stream=True)
    except (httpx.PoolTimeout, httpx.ConnectTimeout):
        return CallResult("aborted" if call.kind == "abort" else "unexpected", "no", f"{call.label}: not sent")
    except httpx.TimeoutException:
        if call.kind == "abort":
            return CallResult("aborted", "maybe")
        return CallResult("unexpected", "maybe", f"{call.label}: client timeout")
    except Exception as exc:  # a broken connection: this request failed, the soak goes on
        return CallResult("unexpected", "maybe", f"{call.label}: {type(exc).__name__}: {exc}")
    try:
        if response.status_code != 200:
            return refused(call, response.status_code, await response.aread())
        if call.kind == "bad":
            await response.aread()
            return CallResult("unexpected", "yes", f"{call.label}: HTTP 200 to a malformed request")
        if call.close_after_events == 0:
            return CallResult("aborted", "yes")  # the server began it: closing now aborts it
        return await read_answer(response, call)
    except httpx.TimeoutException:
        return CallResult("aborted" if call.kind == "abort" else "unexpected", "yes", f"{call.label}: timeout")
    except Exception as exc:
        return CallResult("unexpected", "yes", f"{call.label}: {type(exc).__name__}: {exc}")
    finally:
        await response.aclose()  # unread: httpx drops the connection, the server sees a disconnect


async def read_answer(response: httpx.Response, call: SoakCall) -> CallResult:
    """A 200: the whole JSON answer, or the stream up to [DONE] (or ``close_after_events`` events)."""
    if not call.stream:
        answer = json.loads(await response.aread())
        if all("choices" in a or "meta_info" in a for a in (answer if isinstance(answer, list) else [answer])):
            return CallResult("completed", "yes")
        return CallResult("unexpected", "yes", f"{call.label}: an answer with no choices")
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return CallResult("completed", "yes")
        if "error" in json.loads(data):
            return CallResult("unexpected", "yes", f"{call.label}: error event: {data[:160]}")
        events += 1
        if call.close_after_events is not None and events >= call.close_after_events:
            return CallResult("disconnected", "yes")
    return CallResult("unexpected", "yes", f"{call.label}: the stream ended without [DONE]")


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class SoakReport:
    ok: bool
    problems: list[str]
    counts: OutcomeCounts
    leaks: int  # leak problems found (in the cache, the slots, the RSS)
    server_finished: int | None  # requests_total delta
    finish_reasons: dict[str, int]
    evicted_tokens: int | None  # /metrics deltas: the pool was under pressure when these are > 0
    retractions: int | None
    rss_warm_bytes: int | None
    rss_end_bytes: int | None
    duration_s: float  # sending and answering, without the final wait and checks
    cache: dict[str, Any] = field(default_factory=dict)  # the final /cache?check=true
    abuse: dict[str, Any] = field(default_factory=dict)  # huge bodies, slow loris, small requests' TTFT p99

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        c = self.counts

        def mib(value: int | None) -> str:
            return "n/a" if not value else f"{value / MiB:.0f} MiB"

        accepted = str(c.accepted_min) if c.accepted_min == c.accepted_max else f"{c.accepted_min}..{c.accepted_max}"
        rows = [
            ("Requests sent", c.sent),
            ("Completed", c.completed),
            ("Disconnects", c.disconnected),
            ("Aborts", c.aborted),
            ("Bad (4xx as expected)", c.bad_rejected),
            ("503 (overloaded)", c.overloaded),
            ("Unexpected errors", c.unexpected),
            (
                "Server requests_total delta",
                f"{self.server_finished} (accepted {accepted}; "
                + ", ".join(f"{k} {v}" for k, v in sorted(self.finish_reasons.items()))
                + ")",
            ),
            ("Pool pressure", f"{self.evicted_tokens} tokens evicted, {self.retractions} retractions"),
            ("Leaks found", self.leaks),
            ("RSS after warm-up", mib(self.rss_warm_bytes)),
            ("RSS at end (idle)", mib(self.rss_end_bytes)),
            ("Duration", f"{self.duration_s:.1f} s"),
            ("Requests/s", f"{c.sent / self.duration_s:.1f}" if self.duration_s else "n/a"),
        ]
        if self.abuse:
            a, p99 = self.abuse, self.abuse["small_ttft_p99_s"]
            rows += [
                ("Huge bodies (rejected/sent)", f"{a['huge_bodies_rejected']}/{a['huge_bodies_sent']}"),
                ("Slow-loris connections", a["slow_loris_connections"]),
                ("Small requests' TTFT p99", "n/a" if p99 is None else f"{p99 * 1000:.0f} ms ({a['small_requests']})"),
            ]
        lines = ["=" * 20 + " Soak " + "=" * 20, *(f"{name:<32}{value}" for name, value in rows)]
        lines.append("Result: " + ("OK" if self.ok else "FAILED"))
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


async def server_counters(control: httpx.AsyncClient, base_url: str) -> dict[str, int] | None:
    """/metrics counters: ``finish:REASON`` (requests_total), ``evicted_tokens``, ``retractions``; None if off."""
    response = await control.get(base_url + "/metrics")
    if response.status_code != 200:
        return None
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            name = sample.name.removeprefix("radixserve:").removesuffix("_total")
            if name == "requests":
                found["finish:" + sample.labels["finish_reason"]] = int(sample.value)
            elif name in ("evicted_tokens", "retractions"):
                found[name] = int(sample.value)
    return found


async def server_rss(control: httpx.AsyncClient, base_url: str, pid: int | None) -> int | None:
    """Resident memory of the server: /proc/<pid>/status where we know the pid, else /server_info."""
    if pid is not None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    response = await control.get(base_url + "/server_info")
    if response.status_code != 200:
        return None
    return int(response.json()["process"]["rss_bytes"]) or None  # 0: the server could not tell


async def wait_idle(control: httpx.AsyncClient, base_url: str, timeout: float) -> None:
    """Until nothing runs or waits and requests_total stays put for a second (or ``timeout``)."""
    deadline, quiet_since, last = time.monotonic() + timeout, None, None
    while time.monotonic() < deadline:
        cache = (await control.get(base_url + "/cache", params={"top": 0})).json()
        finished = await server_counters(control, base_url)
        idle = not cache["running_requests"] and not cache["waiting_requests"]
        if not idle or finished != last:
            quiet_since, last = (time.monotonic() if idle else None), finished
        elif quiet_since is not None and time.monotonic() - quiet_since >= 1.0:
            return
        await asyncio.sleep(0.25)


@dataclass(frozen=True)
class FinalState:
    counters: dict[str, int] | None
    cache: dict[str, Any] | None
    rss_bytes: int | None
    error: str | None = None


async def final_state(control: httpx.AsyncClient, base_url: str, pid: int | None, idle_timeout: float) -> FinalState:
    """Once idle (or after ``idle_timeout`` s): the counters, ``/cache?check=true``, the RSS."""
    try:
        await wait_idle(control, base_url, idle_timeout)
        counters = await server_counters(control, base_url)
        cache = (await control.get(base_url + "/cache", params={"top": 0, "check": "true"})).raise_for_status()
        return FinalState(counters, cache.json(), await server_rss(control, base_url, pid))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return FinalState(None, None, None, f"the server stopped answering after the load: {type(exc).__name__}: {exc}")


async def server_facts(control: httpx.AsyncClient, base_url: str) -> ServerFacts:
    info = (await control.get(base_url + "/server_info")).raise_for_status().json()
    model = (await control.get(base_url + "/v1/models")).raise_for_status().json()["data"][0]["id"]
    return ServerFacts(str(model), int(info["engine"]["vocab_size"]), int(info["engine"]["context_length"]))


async def drive(
    base_url: str, calls: list[SoakCall], concurrency: int, duration: float, on_done: list[CallResult]
) -> int:
    """Send ``calls`` from ``concurrency`` tasks, none new after ``duration`` s; results into ``on_done``."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    deadline, pending, sent = time.monotonic() + duration, iter(calls), 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:

        async def worker() -> None:
            nonlocal sent
            for call in pending:  # one shared iterator: each call goes to one task
                if time.monotonic() > deadline:
                    return
                sent += 1
                on_done.append(replace(await send_call(client, base_url, call), num_requests=call.num_requests))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


async def run_soak(
    base_url: str,
    *,
    requests: int,
    concurrency: int,
    duration: float,
    disconnect_fraction: float,
    bad_fraction: float,
    abort_fraction: float,
    seed: int = 0,
    server_pid: int | None = None,
    idle_timeout: float = 60.0,
    huge_body_clients: int = 0,
    slow_loris_clients: int = 0,
    huge_body_bytes: int = 16_000_000,
    max_small_ttft: float | None = None,
) -> SoakReport:
    """Load ``base_url`` (a radixserve with --enable-metrics), wait for it to go idle, check for leaks."""
    base_url = base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=60.0) as control:
        facts = await server_facts(control, base_url)
        calls = plan_calls(
            requests,
            facts,
            disconnect_fraction=disconnect_fraction,
            bad_fraction=bad_fraction,
            abort_fraction=abort_fraction,
            seed=seed,
        )
        before = await server_counters(control, base_url)
        results: list[CallResult] = []
        rss_warm: list[int | None] = []

        async def measure_warm() -> None:  # once the first ~10 % of requests have their outcome
            while len(results) < max(1, requests // 10) and not load.done():
                await asyncio.sleep(0.05)
            rss_warm.append(await server_rss(control, base_url, server_pid))

        start, stop = time.perf_counter(), asyncio.Event()
        abuse, abusers = start_abuse(
            base_url, facts.model, huge_body_clients, slow_loris_clients, huge_body_bytes, stop
        )
        load = asyncio.ensure_future(drive(base_url, calls, concurrency, duration, results))
        await measure_warm()
        sent = await load
        stop.set()
        await asyncio.gather(*abusers)
        elapsed = time.perf_counter() - start
        end = await final_state(control, base_url, server_pid, idle_timeout)
    return build_report(sent, results, before, end, rss_warm[0], elapsed, abuse, bool(abusers), max_small_ttft)


def build_report(
    sent: int,
    results: list[CallResult],
    before: dict[str, int] | None,
    end: FinalState,
    rss_warm: int | None,
    elapsed: float,
    abuse: AbuseLog,
    abused: bool,
    max_small_ttft: float | None,
) -> SoakReport:
    """Every check on what the run measured."""
    after = end.counters
    delta = {k: v - before.get(k, 0) for k, v in after.items()} if before is not None and after is not None else {}
    reasons = {k.removeprefix("finish:"): v for k, v in delta.items() if k.startswith("finish:")}
    finished = sum(reasons.values()) - abuse.small_accepted if delta else None  # the probe's are not the load's
    counts = OutcomeCounts.of(sent, results)
    leaks = check_leaks(end.cache, rss_warm, end.rss_bytes)
    problems = check_outcomes(counts, finished) + leaks + ([end.error] if end.error else [])
    problems += abuse.problems(max_small_ttft)
    return SoakReport(
        not problems,
        problems,
        counts,
        len(leaks),
        finished,
        reasons,
        delta.get("evicted_tokens"),
        delta.get("retractions"),
        rss_warm,
        end.rss_bytes,
        elapsed,
        end.cache or {},
        abuse.summary() if abused else {},
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="radixserve bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=None, help="a running radixserve with --enable-metrics; else start one")
    parser.add_argument("--model-path", default=None, help="model for the server started here (default: tiny, 4k)")
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool of the server started here")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds after which no new request is sent")
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--bad-fraction", type=float, default=0.1)
    parser.add_argument("--abort-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--huge-body-clients", type=int, default=0, help="clients sending 16 MB bodies meanwhile")
    parser.add_argument("--slow-loris-clients", type=int, default=0, help="clients trickling a body a byte a second")
    parser.add_argument("--huge-body-bytes", type=int, default=16_000_000)
    parser.add_argument(
        "--max-small-ttft", type=float, default=1.0, help="seconds: small requests' TTFT p99 bound under abuse"
    )
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON")
    args = parser.parse_args(argv)
    load: dict[str, Any] = dict(
        requests=args.requests,
        concurrency=args.concurrency,
        duration=args.duration,
        disconnect_fraction=args.disconnect_fraction,
        bad_fraction=args.bad_fraction,
        abort_fraction=args.abort_fraction,
        seed=args.seed,
        huge_body_clients=args.huge_body_clients,
        slow_loris_clients=args.slow_loris_clients,
        huge_body_bytes=args.huge_body_bytes,
        max_small_ttft=args.max_small_ttft,
    )
    if args.base_url:
        report = asyncio.run(run_soak(args.base_url, **load))
    else:
        report = soak_own_server(args.model_path, args.max_total_tokens, load)
    print(report.table())
    if args.output:
        args.output.write_text(json.dumps(report.to_dict(), indent=2))
    if not report.ok:
        raise SystemExit(1)


def soak_own_server(model_path: str | None, max_total_tokens: int, load: dict[str, Any]) -> SoakReport:
    """Start a server (tiny 4k-context model by default), soak it, stop it: it must exit 0."""
    with tempfile.TemporaryDirectory(prefix="radixserve-soak-") as tmp:
        model = model_path or build_engine_folder(Path(tmp) / "tiny-llama-4k", max_position_embeddings=4096)
        server = ServerProcess(
            "--enable-metrics", "--max-total-tokens", str(max_total_tokens), "--log-level", "warning", model_path=model
        ).start(timeout=600)
        assert server.proc is not None
        try:
            report = asyncio.run(run_soak(server.url, server_pid=server.proc.pid, **load))
        finally:
            code = server.stop()
        if code != 0:
            report.problems.append(f"the server exited with status {code} after SIGTERM")
            report.ok = False
        if not report.ok:
            print("---- server log (last 40 lines) ----\n" + "\n".join(server.log().splitlines()[-40:]))
    return report
