"""``radixserve bench programs``: SGLang frontend programs against radixserve, radix cache on and off.

Two servers on the same model start side by side, one with the radix cache and one with
``--disable-radix-cache``; each workload of ``sgl_programs`` (5-shot multiple choice with
``select``, tree-of-thought with nested ``fork``, multi-turn chat, JSON with a schema) runs as
one ``run_batch`` on the first, then on the second, so load on the machine hits both alike.
Per run: programs per second, prompt tokens computed, and the cache hit rate (prompt tokens
read from the cache / all prompt tokens, from the server's counters). The cache is flushed
before every run; a warm-up program runs first and is not counted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import ServerProcess
from tests.support.tiny_model import build_byte_engine_folder


def flush(url: str, timeout: float = 120.0) -> None:
    """Empty the cache once the server is idle (a 400 while requests are still in flight)."""
    deadline = time.monotonic() + timeout
    while (response := httpx.post(url + "/flush_cache", timeout=60)).status_code == 400:
        if time.monotonic() > deadline:
            response.raise_for_status()
        time.sleep(0.2)
    response.raise_for_status()


def counters(url: str) -> dict[str, int]:
    scheduler = httpx.get(url + "/server_info", timeout=60).json()["scheduler"]
    return {"cached": int(scheduler["cached_tokens"]), "prefill": int(scheduler["prefill_tokens"])}


def run_one(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One workload's batch on one server: its figures."""
    import sglang as sgl

    from benchmarks import sgl_programs  # sglang is a test extra: imported only when a bench runs

    backend = sgl.RuntimeEndpoint(url, chat_template_name=args.chat_template)
    program, batch = sgl_programs.workload(name, args.count, args.seed, args.max_tokens, args.json_max_tokens)
    flush(url)
    program.run(**batch[0], backend=backend)  # warm-up (compiles the schema, first-call costs)
    flush(url)
    before = counters(url)
    started = time.perf_counter()
    states = program.run_batch(batch, backend=backend, num_threads=args.num_threads)
    seconds = time.perf_counter() - started
    after = counters(url)
    cached, prefill = after["cached"] - before["cached"], after["prefill"] - before["prefill"]
    return {
        "seconds": seconds,
        "throughput": len(states) / seconds,
        "hit_rate": cached / max(cached + prefill, 1),
        "prefill_tokens": prefill,
        "valid": validity(name, states),
    }


def validity(name: str, states: list[Any]) -> str:
    """``"ok/all"`` outputs of the right shape, and how many of the others ``max_tokens`` cut short."""
    from benchmarks import sgl_programs

    ok = sum(state.error() is None and sgl_programs.valid(name, state) for state in states)
    cut = sum(state.error() is None and sgl_programs.stopped_by_length(name, state) for state in states)
    return f"{ok}/{len(states)}" + (f" ({cut} cut by max_tokens)" if cut else "")


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| workload | programs/s, radix | programs/s, no cache | speed-up | hit rate, radix | prompt tokens "
        "computed, radix / no cache | valid (radix, none) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, by_cache in results.items():
        on, off = by_cache["radix"], by_cache["none"]
        lines.append(
            f"| {name} | {on['throughput']:.2f} | {off['throughput']:.2f} "
            f"| {on['throughput'] / off['throughput']:.2f}x "
            f"| {on['hit_rate']:.0%} | {on['prefill_tokens']:,} / {off['prefill_tokens']:,} "
            f"| {on['valid']}, {off['valid']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    parser = argparse.ArgumentParser(prog="radixserve bench programs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mmlu,tree,chat,json", help="comma-separated: mmlu, tree, chat, json")
    parser.add_argument("--count", type=int, default=16, help="programs per workload")
    parser.add_argument("--num-threads", type=int, default=8, help="run_batch's client threads (programs in flight)")
    parser.add_argument("--max-tokens", type=int, default=16, help="per gen (json: see --json-max-tokens)")
    parser.add_argument(
        "--json-max-tokens",
        type=int,
        default=None,
        help="the JSON gen's limit (default: 4x --max-tokens; 256 with --tiny, whose tokens are bytes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="each server's KV pool")
    parser.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--chat-template", default="chatml", help="the frontend's template name (SmolLM2: chatml)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny byte-level Llama (a quick smoke run)")
    args = parser.parse_args(argv)
    model_path = args.model_path
    if args.tiny and args.json_max_tokens is None:
        # A byte per token, and the random model fills the name (up to 24 characters, up to 4 bytes
        # each) before closing it: the object takes ~150 tokens where SmolLM2 needs ~40.
        args.json_max_tokens = 256
    if args.tiny:
        folder = Path(tempfile.mkdtemp(prefix="radixserve-")) / "tiny-byte-llama"
        model_path = build_byte_engine_folder(folder, max_position_embeddings=8192)  # byte prompts are long
    common = ("--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning")
    servers = {
        "radix": ServerProcess(*common, model_path=model_path),
        "none": ServerProcess(*common, "--disable-radix-cache", model_path=model_path),
    }
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for server in servers.values():
            server.start(timeout=300)
        for name in args.workloads.split(","):
            results[name] = {cache: run_one(server.url, name, args) for cache, server in servers.items()}
            print(f"{name}: " + ", ".join(f"{c} {r['seconds']:.1f} s" for c, r in results[name].items()), flush=True)
    finally:
        for server in servers.values():
            if server.proc is not None:
                server.stop()
    print(table(results))
    return results


if __name__ == "__main__":
    main()
