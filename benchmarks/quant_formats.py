"""radixserve and llama.cpp side by side on GGUF files of each type: ``radixserve bench quant-formats``.

For each ``--model-path`` (several, comma-separated: the same model requantized by llama-quantize to
Q4_0, Q4_K_M, Q6_K, ...) and each ``--num-threads``, in one run, alternately over ``--rounds`` rounds
(each cell the best round; the order flips every round so that a load trend hits both alike):

- radixserve at the engine defaults (``--quantization auto``: the file's own blocks where a kernel runs
  them): prefill tok/s of a ``--context``-token prompt and decode tok/s at ``--context`` for batch 1 and
  16, with model-speed's measuring functions (the model step alone, no scheduler);
- ``llama-bench -m FILE -t T -p CONTEXT -n 64 -d 0,CONTEXT -o json``: pp512 and tg64 at the defaults, and
  tg64 after CONTEXT tokens (``tg@ctx``: the same context as radixserve's decode, so ``b1 / tg@ctx`` is the
  like-for-like ratio; ``b1 / tg`` sets our decode at 512 tokens against theirs at none), from
  ``--llama-bench`` or ``$LLAMA_BENCH``; without one the llama.cpp columns say "-" (a note says why).

Also the weights radixserve holds (``weight_bytes`` of the loaded model) against the file's tensor bytes.
How to build llama-bench and llama-quantize: docs/benchmarks/index.md, "Quantization formats side by side".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch

from benchmarks.model_speed import build, cpu_model, decode_tok_s, prefill_tok_s
from radixserve.engine import Engine
from radixserve.model.quant import weight_bytes

LLAMA_GEN_LEN = 64  # llama-bench's tg: tokens generated after an empty context


class FileTensors(NamedTuple):
    """What a GGUF stores: how many tensors of each type, and their bytes (metadata and vocabulary aside)."""

    types: dict[str, int]
    tensor_bytes: int


def file_tensors(path: str | os.PathLike[str]) -> FileTensors:
    """The tensor types of ``path`` by count (e.g. {"F32": 61, "Q4_K": 120, "Q6_K": 31}) and their bytes."""
    tensors = gguf.GGUFReader(path).tensors
    types = Counter(t.tensor_type.name for t in tensors)
    return FileTensors(dict(sorted(types.items())), sum(int(t.n_bytes) for t in tensors))


def llama_bench(binary: str, path: str, threads: int, context_len: int) -> dict[str, float]:
    """llama.cpp's own tok/s on ``path``: ``pp`` (a ``context_len`` prompt), ``tg`` (64 generated tokens) and
    ``tg_ctx`` (64 generated after ``context_len`` tokens of context)."""
    command = [binary, "-m", path, "-t", str(threads), "-p", str(context_len), "-n", str(LLAMA_GEN_LEN)]
    command += ["-d", f"0,{context_len}", "-o", "json"]
    records = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    found = {}
    for r in records:
        if r["n_prompt"] and not r.get("n_depth"):
            found["pp"] = float(r["avg_ts"])
        elif r["n_gen"]:
            found["tg_ctx" if r.get("n_depth") else "tg"] = float(r["avg_ts"])
    return found


def radixserve_speeds(engine: Engine, threads: int, args: argparse.Namespace) -> dict[str, float]:
    """radixserve's step on the same file: prefill tok/s and decode tok/s at batch 1 and 16, at ``threads``."""
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    found = {"prefill": prefill_tok_s(engine, args.context, rng)}
    found.update({f"decode {b}": decode_tok_s(engine, b, args.context, args.decode_steps, rng) for b in (1, 16)})
    return found


def measure_file(path: str, thread_counts: list[int], args: argparse.Namespace) -> list[dict[str, float | str]]:
    """One file at each thread count: both engines alternately, each cell the best of ``args.rounds``."""
    engine = build({"quantization": args.quantization}, argparse.Namespace(**vars(args) | {"model_path": path}), [16])
    steps: list[tuple[int, Callable[[], dict[str, float]]]] = []
    for threads in thread_counts:
        steps.append((threads, partial(radixserve_speeds, engine, threads, args)))
        if args.llama_bench:
            steps.append((threads, partial(llama_bench, args.llama_bench, path, threads, args.context)))
    best: dict[int, dict[str, float]] = {threads: {} for threads in thread_counts}
    for round_ in range(args.rounds):
        for threads, step in steps if round_ % 2 == 0 else steps[::-1]:
            best[threads].update({key: max(best[threads].get(key, 0.0), value) for key, value in step().items()})
    info = engine.describe()
    held: dict[str, float | str] = {
        "weights": weight_bytes(engine.loaded.model),
        "quantization": str(info["resolved_quantization"]),
    }
    print(f"{Path(path).name}: {info['quantization_detail']}")  # the detail starts with the method's name
    return [{**best[threads], **held} for threads in thread_counts]


def row(path: str, threads: int, cells: dict[str, float | str]) -> dict[str, str]:
    """The table's row of one file at one thread count (llama.cpp cells "-" when it did not run)."""
    stored = file_tensors(path)

    def ratio(ours: str, theirs: str) -> str:
        return f"{float(cells[ours]) / float(cells[theirs]):.2f}x" if theirs in cells else "-"

    llama = {key: f"{float(cells[key]):.0f}" if key in cells else "-" for key in ("pp", "tg", "tg_ctx")}
    return {
        "file": f"{Path(path).name} {threads}t",
        "llama pp / tg / tg@ctx": f"{llama['pp']} / {llama['tg']} / {llama['tg_ctx']}",
        "rs prefill / b1 / b16": f"{cells['prefill']:.0f} / {cells['decode 1']:.1f} / {cells['decode 16']:.1f}",
        "prefill / pp": ratio("prefill", "pp"),
        "b1 / tg": ratio("decode 1", "tg"),
        "b1 / tg@ctx": ratio("decode 1", "tg_ctx"),
        "weights / file MiB": f"{float(cells['weights']) / 2**20:.1f} / {stored.tensor_bytes / 2**20:.1f}",
        "quantization": str(cells["quantization"]),
        "types": " ".join(f"{kind}:{count}" for kind, count in stored.types.items()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench quant-formats", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="one .gguf or several, comma-separated")
    parser.add_argument("--num-threads", default="1", help="a thread count, or several (1,2): each file at each")
    parser.add_argument("--context", type=int, default=512, help="prefill length and decode context, tokens")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both engines in turn; each cell the best")
    parser.add_argument("--quantization", default="auto", help="radixserve's --quantization (default: auto)")
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="default: $LLAMA_BENCH")
    args = parser.parse_args(argv)
    args.extend_len = 0  # model_speed.build sizes the KV pool with it
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; llama-bench: {args.llama_bench or '-'}")
    if not args.llama_bench:
        print("note: no llama-bench (--llama-bench or $LLAMA_BENCH): the llama.cpp columns are '-'")
    print(
        f"llama pp{args.context} / tg{LLAMA_GEN_LEN} / tg{LLAMA_GEN_LEN} @ {args.context} ctx, radixserve prefill "
        f"{args.context} / decode batch 1 and 16 @ {args.context} ctx: tok/s; ratios radixserve / llama.cpp"
    )
    thread_counts = [int(t) for t in args.num_threads.split(",")]
    rows = [
        row(path, threads, cells)
        for path in args.model_path.split(",")
        for threads, cells in zip(thread_counts, measure_file(path, thread_counts, args))
    ]
    widths = {key: max(len(key), *(len(r[key]) for r in rows)) for key in rows[0]}
    print("  ".join(f"{key:<{width}}" for key, width in widths.items()).rstrip())
    for r in rows:
        print("  ".join(f"{r[key]:<{width}}" for key, width in widths.items()).rstrip())
