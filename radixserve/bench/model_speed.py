"""The model step's speed, today's path next to the new one in one run: ``radixserve bench model-speed``.

On the embedded SmolLM2-135M (or ``--model-path``), one engine per column,
built and measured one after the other in the same process and thread count:

- ``reference``: float32, gather + SDPA attention (the path before in-place attention);
- ``auto``: the defaults (``--dtype auto``, ``--attention-backend auto``);
- ``auto+int8``: the defaults with ``--quantization int8``;
- ``auto+kv-bf16``: the defaults with ``--kv-cache-dtype bfloat16`` (half the K/V bytes per token).

``--num-threads 1,2`` measures every column at each thread count, back to back in
one run (column ``auto 2t``), so the 2-vs-1 ratio shares the machine's load.

Rows: cold prefill of a 2,048-token prompt; decode at 2,048 tokens of context
for batch 1, 4 and 16 (aggregate tokens/s; each request's context in its own
slots, allocated as the engine would: prompt in one run, then a slot a step);
weight and KV memory. Decode runs the model step alone (ModelRunner), no
scheduler. Absolute figures move with the machine's load: read columns of one
run side by side. Token ids are seeded random draws.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from radixserve.engine import Engine
from radixserve.memory import TokenAllocator
from radixserve.model.precision import CpuFeatures, resolve_dtype
from radixserve.model.quant import weight_bytes
from radixserve.model.runner import StepInput

COLUMNS: dict[str, dict[str, str]] = {
    "reference": {"dtype": "float32", "attention_backend": "reference"},
    "auto": {},
    "auto+int8": {"quantization": "int8"},
    "auto+kv-bf16": {"kv_cache_dtype": "bfloat16"},
}


def timed(fn: Callable[[], object], repeat: int = 2) -> float:
    """Best of ``repeat`` wall-clock seconds (the machine is shared: best is the least noisy)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def prefill_tok_s(engine: Engine, num_tokens: int, rng: np.random.Generator) -> float:
    runner, allocator = engine.executor.runner, engine.allocator
    ids = rng.integers(0, engine.loaded.config.vocab_size, num_tokens)
    slots = allocator.alloc(num_tokens)
    assert slots is not None
    seconds = timed(lambda: runner.forward([StepInput(ids, slots)], "extend"))
    allocator.free(slots)
    return num_tokens / seconds


def _one_slot(allocator: TokenAllocator) -> np.ndarray:
    slot = allocator.alloc(1)
    assert slot is not None, "pool too small"
    return slot


def decode_tok_s(engine: Engine, batch: int, context_len: int, steps: int, rng: np.random.Generator) -> float:
    """Aggregate tokens/s of a decode step (the median of ``steps``) for ``batch`` requests at ``context_len``."""
    runner, allocator = engine.executor.runner, engine.allocator
    contexts = [allocator.alloc(context_len) for _ in range(batch)]
    assert all(c is not None for c in contexts), "pool too small"
    ctx: list[np.ndarray] = [c for c in contexts if c is not None]
    tokens = rng.integers(0, engine.loaded.config.vocab_size, batch)
    runner.forward([StepInput([int(t)], c) for t, c in zip(tokens, ctx)], "decode")  # warm-up
    seconds = []
    for _ in range(steps):
        ctx = [np.concatenate([c, _one_slot(allocator)]) for c in ctx]
        t0 = time.perf_counter()
        logits = runner.forward([StepInput([int(t)], c) for t, c in zip(tokens, ctx)], "decode")
        seconds.append(time.perf_counter() - t0)
        tokens = logits.argmax(-1).numpy()
    allocator.free(np.concatenate(ctx))
    # The median step: on a shared machine a step that lost its core to another job is an outlier.
    return batch / float(np.median(seconds))


def measure(options: dict[str, str], args: argparse.Namespace, batches: list[int], threads: int) -> dict[str, str]:
    pool_tokens = max(batches) * (args.context + args.decode_steps + 1) + args.context + 64
    engine = Engine.create(model_path=args.model_path, num_threads=threads, max_total_tokens=pool_tokens, **options)
    rng = np.random.default_rng(0)
    cells = {"prefill": f"{prefill_tok_s(engine, args.context, rng):.0f}"}
    decode = {b: decode_tok_s(engine, b, args.context, args.decode_steps, rng) for b in batches}
    cells.update({f"decode {b}": f"{tok_s:.1f}" for b, tok_s in decode.items()})
    cells["ratio"] = f"{decode[max(batches)] / decode[min(batches)]:.1f}x"
    info = engine.describe()
    cells["dtype"] = f"{info['resolved_dtype']}/{info['resolved_kv_cache_dtype']}, {info['resolved_attention_backend']}"
    cells["weights"] = f"{weight_bytes(engine.loaded.model) / 2**20:.0f} MiB"
    cells["kv"] = f"{info['kv_tokens_per_gib']:,}"
    del engine
    gc.collect()
    return cells


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench model-speed", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--num-threads", default="1", help="a thread count, or several (1,2): each column at each")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--context", type=int, default=2048, help="prefill length and decode context, tokens")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"a subset of {','.join(COLUMNS)}")
    args = parser.parse_args(argv)
    thread_counts = [int(t) for t in args.num_threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    cpu = CpuFeatures.detect()
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}, capability {cpu.capability}, "
        f"AMX-BF16 {cpu.amx_bf16}, AVX512-BF16 {cpu.avx512_bf16}; {args.num_threads} thread(s)"
    )
    print(f"dtype auto -> {resolve_dtype('auto', torch.device('cpu'), cpu)[1]}")
    runs = [(name, t) for t in thread_counts for name in args.columns.split(",")]
    names = [name if len(thread_counts) == 1 else f"{name} {t}t" for name, t in runs]
    results = {label: measure(COLUMNS[name], args, batches, t) for label, (name, t) in zip(names, runs)}
    labels = {"prefill": f"prefill tok/s, {args.context}-token prompt"}
    labels.update({f"decode {b}": f"decode tok/s, batch {b} @ {args.context} ctx" for b in batches})
    labels.update(ratio=f"decode batch {max(batches)} / batch {min(batches)}", dtype="dtype / KV dtype, attention")
    labels.update(weights="weights", kv="KV tokens per GiB")
    print(f"{'':<36}" + "".join(f"{name:>26}" for name in names))
    for key, label in labels.items():
        print(f"{label:<36}" + "".join(f"{results[name][key]:>26}" for name in names))


if __name__ == "__main__":
    main()
