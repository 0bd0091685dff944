"""radixserve and llama.cpp's ``llama-server`` end to end, in one run: ``radixserve bench peer-serve``.

The serving side of the quantization formats' comparison (``bench quant-formats`` measures the model step
alone): the same requests through each server's OpenAI API (``bench serve``'s client: prompts as token ids,
streamed, ``ignore_eos``, greedy), each server started cold for every cell and given the same thread count.

- radixserve on each ``--model-path`` (e.g. the Q4_0 file and the Q4_K_M file), at its defaults plus
  ``--radixserve-args``;
- ``llama-server`` (``--llama-server`` or ``$LLAMA_SERVER``) on ``--llama-model`` (its fastest x86 format is
  Q4_0, which it repacks at load): ``-m FILE -t T -tb T -c 65536 -np 16 -kvu`` (16 slots sharing one
  32k-token context, as BENCHMARKS §8 ran it), plus ``--llama-args``.

Workloads (BENCHMARKS §8): ``shared``, 32 requests of one 2,048-token shared prefix + an 80-token question,
32 tokens out; ``no-sharing``, 16 prompts of 1,024-2,048 tokens sharing nothing, 32 tokens out (``--num-requests``
and ``--prompt-len`` scale both). Each at every ``--concurrency``. Without a llama-server binary only radixserve's
rows are measured (a note says why). How to build llama-server: docs/benchmarks/index.md, "Quantization
formats side by side".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np

from benchmarks.serve import BenchResult, run_benchmark
from benchmarks.workloads import TraceRequest, generated_shared_prefix, no_sharing
from tests.support.server_process import ServerProcess


class Shape(NamedTuple):
    """The workloads' size: ``num_requests`` sharing one ``prompt_len``-token prefix (+ an 80-token question), or
    ``num_requests // 2`` prompts of ``prompt_len // 2`` to ``prompt_len`` tokens sharing nothing; 32 out."""

    num_requests: int = 32
    prompt_len: int = 2048
    vocab_size: int = 49152  # SmolLM2's: token ids stay below it
    output_len: int = 32


def shared(shape: Shape) -> list[TraceRequest]:
    question_len = min(80, shape.prompt_len // 4)
    return generated_shared_prefix(
        num_groups=1,
        prompts_per_group=shape.num_requests,
        system_prompt_len=shape.prompt_len,
        question_len=question_len,
        output_len=shape.output_len,
        vocab_size=shape.vocab_size,
    )


def unshared(shape: Shape) -> list[TraceRequest]:
    lens = (shape.prompt_len // 2, shape.prompt_len)
    outputs = (shape.output_len, shape.output_len)
    return no_sharing(
        num_requests=shape.num_requests // 2, prompt_len=lens, output_len=outputs, vocab_size=shape.vocab_size
    )


DEFAULT = Shape()
WORKLOADS: dict[str, Callable[[Shape], list[TraceRequest]]] = {"shared": shared, "no-sharing": unshared}
LLAMA_CONTEXT = 65536  # tokens shared by llama-server's 16 slots (-kvu): 16 x ~2.2k of the shared workload need > 32k


class Peer(NamedTuple):
    """One server to measure: a name for the table, the file it serves and how to start it."""

    name: str
    model_path: str
    make: Callable[[], ServerProcess]


def radixserve_peer(path: str, threads: int, extra: list[str]) -> Peer:
    flags = ["--num-threads", str(threads), "--enable-metrics", "--log-level", "warning", *extra]
    return Peer("radixserve", path, lambda: ServerProcess(*flags, model_path=path))


def llama_peer(binary: str, path: str, threads: int, extra: list[str]) -> Peer:
    flags = ["-m", path, "-t", str(threads), "-tb", str(threads), "-c", str(LLAMA_CONTEXT), "-np", "16", "-kvu"]
    return Peer("llama.cpp", path, lambda: ServerProcess(*flags, *extra, program=[binary]))


def measure(peer: Peer, requests: list[TraceRequest], concurrency: int) -> BenchResult:
    """One cell: ``peer`` started cold, the requests sent ``concurrency`` at a time, the server stopped.

    Cold cache, warm code: one short request first (first-call set-up such as loading the kernels is no
    server's steady state), then the cache flushed where the server has the endpoint (radixserve's
    ``/flush_cache``; llama-server keeps that request's 8 tokens in one slot, sharing at most one token with
    the workload's prompts)."""
    with peer.make().start(timeout=600) as server:
        warm = [TraceRequest(np.full(8, 7, dtype=np.int64), np.full(4, 7, dtype=np.int64))]
        asyncio.run(run_benchmark(server.url, warm, progress=False))
        httpx.post(server.url + "/flush_cache", timeout=60)
        return asyncio.run(run_benchmark(server.url, requests, max_concurrency=concurrency, progress=False))


def row(peer: Peer, workload: str, concurrency: int, result: BenchResult, llama_rps: float | None) -> str:
    ratio = f"{result.request_throughput / llama_rps:.2f}x" if llama_rps else "-"
    cells = [
        peer.name,
        Path(peer.model_path).name,
        workload,
        str(concurrency),
        f"{result.request_throughput:.3f}",
        ratio,
        f"{result.output_throughput:.1f}",
        f"{result.ttft.p50_ms:,.0f} / {result.ttft.p90_ms:,.0f}",
        f"{result.itl.p50_ms:.1f}",
        f"{result.total_cached_tokens:,} / {result.total_prompt_tokens:,}",
        f"{result.completed}/{result.completed + result.failed}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| server | file | workload | c | req/s | vs llama.cpp | out tok/s | TTFT p50 / p90 ms | ITL p50 ms "
    "| cached / prompt tokens | done |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench peer-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="radixserve's GGUF files, comma-separated")
    parser.add_argument("--llama-model", default=None, help="llama-server's GGUF (default: the first --model-path)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="default: $LLAMA_SERVER")
    parser.add_argument("--workloads", default="shared,no-sharing", help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=DEFAULT.num_requests, help="shared; no-sharing: half")
    parser.add_argument(
        "--prompt-len", type=int, default=DEFAULT.prompt_len, help="the shared prefix; no-sharing: up to"
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT.vocab_size)
    parser.add_argument("--radixserve-args", default="", help="more flags for radixserve serve (one string)")
    parser.add_argument("--llama-args", default="", help="more flags for llama-server (one string)")
    args = parser.parse_args(argv)
    paths = args.model_path.split(",")
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    peers = [radixserve_peer(path, args.num_threads, shlex.split(args.radixserve_args)) for path in paths]
    llama = None
    if args.llama_server:
        llama = llama_peer(
            args.llama_server, args.llama_model or paths[0], args.num_threads, shlex.split(args.llama_args)
        )
    else:
        print("no llama-server (--llama-server or $LLAMA_SERVER): radixserve's rows only")
    shape = Shape(args.num_requests, args.prompt_len, args.vocab_size)
    print(HEADER, flush=True)
    for workload in workloads:
        requests = WORKLOADS[workload](shape)
        for concurrency in map(int, args.concurrency.split(",")):
            peer_result = None if llama is None else measure(llama, requests, concurrency)
            llama_rps = None if peer_result is None else peer_result.request_throughput
            if llama is not None and peer_result is not None:
                print(row(llama, workload, concurrency, peer_result, llama_rps), flush=True)
            for peer in peers:
                print(row(peer, workload, concurrency, measure(peer, requests, concurrency), llama_rps), flush=True)
