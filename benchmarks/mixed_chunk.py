"""Decoders' inter-token gaps while a long prompt prefills, with mixed chunks off and on.

``radixserve bench mixed-chunk``: N requests decode on the embedded SmolLM2
(or ``--model-path``); once all of them stream, a long prompt arrives and is
prefilled in ``--chunked-prefill-size`` chunks. Between its arrival and its
first token we record each decoder's gaps between tokens, and the time of every
step. Off: prefill and decode steps alternate (a decoder waits one chunk and one
decode step); on (``--enable-mixed-chunk``): each chunk runs in one forward with
every decode. Runs alternate off / on so load on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from radixserve.core import SamplingParams
from radixserve.engine import Engine
from radixserve.scheduler.request import Request


def run_once(engine: Engine, args: argparse.Namespace, round_: int) -> dict[str, float]:
    """One arrival of the long prompt among streaming decoders; gaps and step times in ms."""
    rng = np.random.default_rng(round_)  # fresh prompts each round: nothing is a cache hit
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_new_tokens=100_000, temperature=0, ignore_eos=True)
    sched = engine.scheduler
    decoders = [Request(i, rng.integers(100, vocab - 100, 64), params) for i in range(args.decoders)]
    for req in decoders:
        sched.add(req)
    while not all(r.prefill_done for r in decoders):
        engine.step()
    for _ in range(3):  # steady decoding before the prompt arrives
        engine.step()
    long = Request(99, rng.integers(100, vocab - 100, args.prompt_len), SamplingParams(max_new_tokens=1))
    last = {r.rid: time.perf_counter() for r in decoders}
    counts = {r.rid: len(r.output_ids) for r in decoders}
    gaps: list[float] = []
    steps: list[float] = []
    arrival = time.perf_counter()
    sched.add(long)
    while long.finish_reason is None:
        start = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        steps.append(now - start)
        for req in decoders:
            if len(req.output_ids) > counts[req.rid]:
                gaps.append(now - last[req.rid])
                last[req.rid], counts[req.rid] = now, len(req.output_ids)
    ttft = time.perf_counter() - arrival
    for req in decoders:
        sched.abort(req)
    engine.check_idle_invariants()
    return {
        "max gap": 1000 * max(gaps),
        "p50 gap": 1000 * statistics.median(gaps),
        "steps": len(steps),
        "long step": 1000 * statistics.median(sorted(steps)[len(steps) // 2 :]),
        "prompt ttft": 1000 * ttft,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench mixed-chunk", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--chunked-prefill-size", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    args = parser.parse_args(argv)
    engines = {
        flag: Engine.create(
            model_path=args.model_path,
            chunked_prefill_size=args.chunked_prefill_size,
            dtype=args.dtype,
            num_threads=args.num_threads,
            enable_mixed_chunk=flag,
        )
        for flag in (False, True)
    }
    print(f"{args.decoders} decoders, a {args.prompt_len}-token prompt in {args.chunked_prefill_size}-token chunks")
    print(
        f"{'mixed chunk':<12}{'round':>6}{'max gap ms':>12}{'p50 gap ms':>12}{'steps':>7}{'slow-half step ms':>19}"
        f"{'prompt ttft ms':>16}"
    )
    for round_ in range(args.rounds):
        for flag, engine in engines.items():
            r = run_once(engine, args, round_)
            print(
                f"{'on' if flag else 'off':<12}{round_:>6}{r['max gap']:>12.0f}{r['p50 gap']:>12.0f}"
                f"{r['steps']:>7.0f}{r['long step']:>19.0f}{r['prompt ttft']:>16.0f}"
            )
