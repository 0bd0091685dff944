"""``radixserve bench serve --servers off=URL ngram=URL ...``: the copy workloads through HTTP servers, side by side.

The chat workloads of ``copy_workloads.py`` (code-edit, code-edit-class, rag-quote, agent, prose: the ones
``bench speculative`` runs inside one engine) stream ``/v1/chat/completions`` (greedy, ``max_tokens``; the agent's
turns with its JSON schema as ``response_format``) to each named server in turn: typically the same model served
twice, speculation off and on, and llama.cpp's ``llama-server`` with and without its n-gram drafts. Each pass
sends one workload at one concurrency to one server, on a cold cache where the server has ``POST /flush_cache``
(radixserve); rounds rotate the servers' order so load on the machine hits them alike, and the table gives
medians over rounds.

- concurrency 1: the requests one after another (each sees the cache the earlier ones left: the agent's tree
  drafts come from earlier turns); decode tok/s = output tokens after the first over first chunk to last, summed;
- concurrency 16: 16 requests at once (the workload's prompts repeated); output tok/s over the pass's wall time.

Beside each speed: draft tokens accepted / drafted from the server's ``/metrics`` (``*spec_decode_num_*_tokens``,
radixserve's and llama.cpp's names alike), and how many answers differ from the first server's (greedy: 0 when
both run the same engine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.copy_workloads import SCHEMAS, Workload, repeated, workloads
from benchmarks.serve import RequestRecord, first_model_id, send_request

SPEC_COUNTERS = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@dataclass(frozen=True)
class PassResult:
    """One workload at one concurrency on one server."""

    speed: float  # decode tok/s (concurrency 1) or output tok/s (more)
    drafted: int
    accepted: int
    texts: tuple[str, ...]
    errors: tuple[str, ...]


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int, schema: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "call", "schema": json.loads(schema)}}
    return body


async def spec_counters(client: httpx.AsyncClient, base_url: str) -> tuple[int, int]:
    """(draft tokens, accepted) from the server's /metrics; (0, 0) where it has none."""
    found = dict.fromkeys(SPEC_COUNTERS, 0)
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = await client.get(base_url + "/metrics")
        if response.status_code == 200:
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    name = sample.name.split(":")[-1].removesuffix("_total")
                    if name in found:
                        found[name] += int(sample.value)
    return found[SPEC_COUNTERS[0]], found[SPEC_COUNTERS[1]]


async def run_pass(
    base_url: str, prompts: Workload, concurrency: int, max_tokens: int, schema: str | None
) -> PassResult:
    """Flush the server's cache (where it can), then send ``prompts``, ``concurrency`` at a time."""
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
        with contextlib.suppress(httpx.HTTPError):
            await client.post(base_url + "/flush_cache")
        model = await first_model_id(client, base_url)
        drafted, accepted = await spec_counters(client, base_url)
        records = [RequestRecord(0, max_tokens) for _ in prompts]
        gate = asyncio.Semaphore(concurrency)
        url = base_url + "/v1/chat/completions"
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            async with gate:
                await send_request(client, url, chat_body(model, prompts[i], max_tokens, schema), records[i], t0)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
        drafted_after, accepted_after = await spec_counters(client, base_url)
    done = [r for r in records if r.success]
    if concurrency == 1:
        tokens = sum(r.completion_tokens - 1 for r in done)
        speed = tokens / max(sum((r.e2e_s or 0.0) - (r.ttft_s or 0.0) for r in done), 1e-9)
    else:
        speed = sum(r.completion_tokens for r in done) / duration
    texts = tuple(r.text for r in records)
    errors = tuple(r.error for r in records if r.error is not None)
    return PassResult(speed, drafted_after - drafted, accepted_after - accepted, texts, errors)


Table = dict[tuple[str, int], dict[str, list[PassResult]]]


def side_by_side(
    servers: dict[str, str],
    work: dict[str, tuple[Workload, str | None]],
    concurrencies: list[int],
    rounds: int,
    max_tokens: int,
) -> Table:
    """Every workload (name -> prompts, JSON schema or None) at every concurrency on every server, rounds rotating
    the servers' order."""
    table: Table = {}
    order = list(servers)
    for round_ in range(rounds):
        rotated = order[round_ % len(order) :] + order[: round_ % len(order)]
        for name, (prompts, schema) in work.items():
            for concurrency in concurrencies:
                batch = prompts if concurrency == 1 else repeated(prompts, concurrency)
                for server in rotated:
                    result = asyncio.run(run_pass(servers[server], batch, concurrency, max_tokens, schema))
                    table.setdefault((name, concurrency), {}).setdefault(server, []).append(result)
        print(f"round {round_ + 1}/{rounds} done", flush=True)
    return table


def group_bases(servers: list[str]) -> dict[str, str]:
    """Each server's baseline: the first server of its group (the name's part before the first '-': rs-off,
    rs-ngram; llama-off, llama-cache), which its speed is divided by and its answers compared with."""
    bases: dict[str, str] = {}
    for server in servers:
        bases[server] = next(s for s in servers if s.split("-")[0] == server.split("-")[0])
    return bases


def format_table(table: Table, servers: list[str]) -> str:
    """Medians over rounds: tok/s, its ratio to the server's group baseline, accepted / drafted tokens (summed
    over rounds), and answers that differ from the baseline's (summed)."""
    bases = group_bases(servers)
    compared = [s for s in servers if bases[s] != s]
    head = "| workload | conc | " + " | ".join(f"{s} tok/s" for s in servers) + " | "
    head += "".join(f"{s} / {bases[s]} | " for s in compared) + "accepted / drafted | answers differing |"
    lines = [head, "|---|---:|" + "---:|" * (len(servers) + len(compared)) + "---|---|"]
    for (name, concurrency), by_server in table.items():
        speed = {s: statistics.median(r.speed for r in by_server[s]) for s in servers}
        ratios = "".join(f"{speed[s] / speed[bases[s]]:.2f}x | " if speed[bases[s]] else "n/a | " for s in compared)
        spec = ", ".join(
            f"{s} {sum(r.accepted for r in by_server[s])}/{sum(r.drafted for r in by_server[s])}"
            for s in servers
            if any(r.drafted for r in by_server[s])
        )
        differ = ", ".join(f"{s} {_differing(by_server[bases[s]], by_server[s])}" for s in compared)
        errors = [e for s in servers for r in by_server[s] for e in r.errors]
        cells = " | ".join(f"{speed[s]:.1f}" for s in servers)
        note = f" ({len(errors)} failed: {errors[0]})" if errors else ""
        lines.append(f"| {name} | {concurrency} | {cells} | {ratios}{spec or '-'} | {differ or '-'}{note} |")
    return "\n".join(lines)


def _differing(base: list[PassResult], other: list[PassResult]) -> int:
    """Answers of ``other`` that differ from ``base``'s, pass by pass (the same prompts in the same order)."""
    return sum(a != b for x, y in zip(base, other, strict=True) for a, b in zip(x.texts, y.texts, strict=True))


def main(args: argparse.Namespace) -> None:
    """``bench serve`` with ``--servers``: parsed there (the flags are listed in its --help)."""
    servers = dict(pair.split("=", 1) for pair in args.servers)
    names = args.workload.split(",") if args.workload else list(workloads())
    unknown = sorted(set(names) - set(workloads()))
    if unknown:
        raise SystemExit(f"unknown copy workload(s) {unknown}: choose from {sorted(workloads())}")
    work = {name: (workloads()[name], SCHEMAS.get(name)) for name in names}
    urls = {k: v.rstrip("/") for k, v in servers.items()}
    table = side_by_side(urls, work, args.concurrency, args.rounds, args.max_tokens)
    print(format_table(table, list(servers)))
