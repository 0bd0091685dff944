"""The model step's speed, today's path next to the new one in one run: ``radixserve bench model-speed``.

On the embedded SmolLM2-135M (or ``--model-path``), one engine per column,
all built first, then measured in turn over ``--rounds`` rounds (each cell the best
round), in one process:

- ``reference``: float32, gather + SDPA attention (the path before in-place attention);
- ``auto``: ``--dtype auto``, ``--attention-backend auto``, float weights: every column without a
  ``--quantization`` of its own runs ``none`` (the default, auto, is q4_1 on a Q4_1 GGUF: ``auto+q4_1``);
- ``auto+int8``: the defaults with ``--quantization int8``;
- ``auto+q4_1``: the defaults with ``--quantization q4_1`` (a GGUF's own 4-bit blocks, int8 activations);
- ``auto+q4_1-exact``: the same blocks with float activations (``--quantization q4_1-exact``);
- ``auto+q4_1+kv-bf16``: q4_1 with a bfloat16 KV pool;
- ``auto+kv-bf16``: the defaults with ``--kv-cache-dtype bfloat16`` (half the K/V bytes per token);
- ``auto+kv-int8``: the defaults with ``--kv-cache-dtype int8`` (int8 codes + a bfloat16 scale per token
  and head: 0.52x bfloat16's bytes); ``auto+q4_1-exact+kv-int8``, ``auto+q4_1+kv-int8``: the same on the GGUF's
  own blocks, float or int8 activations;
- ``auto-no-cascade``: the defaults with the paged kernel's shared-prefix pass off (each request
  reads a shared prefix on its own, as before cascade attention).

``--num-threads 1,2`` measures every column at each thread count, back to back in
one run (column ``auto 2t``), so the 2-vs-1 ratio shares the machine's load.

Rows: cold prefill of a 2,048-token prompt; an 80-token extend on 2,048 cached tokens (``--extend-len``;
the KV of the context is whatever the pool holds: the time is the same); decode at 2,048 tokens of context
for batch 1, 4 and 16 (aggregate tokens/s; each request's context in its own
slots, allocated as the engine would: prompt in one run, then a slot a step);
the same batches on a shared prefix (every request's first ``context - 64`` slots are the
same slots, as after a radix hit, then 64 slots of its own); weight and KV memory. Decode
runs the model step alone (ModelRunner), no scheduler. Absolute figures move with the
machine's load: read columns of one run side by side. Token ids are seeded random draws.
"""

from __future__ import annotations

import argparse
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
    "auto+q4_1": {"quantization": "q4_1"},
    "auto+q4_1-exact": {"quantization": "q4_1-exact"},
    "auto+q4_1+kv-bf16": {"quantization": "q4_1", "kv_cache_dtype": "bfloat16"},
    # a float32 model (the default without AVX512-BF16) beside a bfloat16 pool: the 8-bit pool's other baseline
    "auto+q4_1-exact+kv-bf16": {"quantization": "q4_1-exact", "kv_cache_dtype": "bfloat16"},
    "auto+kv-bf16": {"kv_cache_dtype": "bfloat16"},
    "auto+kv-int8": {"kv_cache_dtype": "int8"},
    "auto+q4_1-exact+kv-int8": {"quantization": "q4_1-exact", "kv_cache_dtype": "int8"},
    "auto+q4_1+kv-int8": {"quantization": "q4_1", "kv_cache_dtype": "int8"},
    "auto-no-cascade": {"cascade_attention": "off"},
}
SHARED_TAIL_LEN = 64  # shared-prefix rows: the tokens after the shared prefix each request has alone
# --clock thread: this thread's CPU seconds, which another job taking the core does not add to (at 1 thread the
# step runs in this thread; memory stalls still count).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def timed(fn: Callable[[], object], repeat: int = 2, clock: Callable[[], float] = time.perf_counter) -> float:
    """Best of ``repeat`` seconds on ``clock`` (the machine is shared: best is the least noisy)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def prefill_tok_s(
    engine: Engine, num_tokens: int, rng: np.random.Generator, clock: Callable[[], float] = time.perf_counter
) -> float:
    runner, allocator = engine.executor.runner, engine.allocator
    ids = rng.integers(0, engine.loaded.config.vocab_size, num_tokens)
    slots = allocator.alloc(num_tokens)
    assert slots is not None
    seconds = timed(lambda: runner.forward([StepInput(ids, slots)], "extend"), clock=clock)
    allocator.free(slots)
    return num_tokens / seconds


def extend_ms(
    engine: Engine,
    context_len: int,
    extend_len: int,
    rng: np.random.Generator,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds of one forward of ``extend_len`` new tokens on ``context_len`` cached ones (a question on a
    cached prefix: the TTFT of a radix hit)."""
    runner, allocator = engine.executor.runner, engine.allocator
    slots = allocator.alloc(context_len + extend_len)
    assert slots is not None
    ids = rng.integers(0, engine.loaded.config.vocab_size, extend_len)
    seconds = timed(lambda: runner.forward([StepInput(ids, slots)], "extend"), clock=clock)
    allocator.free(slots)
    return seconds * 1000


def _one_slot(allocator: TokenAllocator) -> np.ndarray:
    slot = allocator.alloc(1)
    assert slot is not None, "pool too small"
    return slot


def decode_tok_s(
    engine: Engine,
    batch: int,
    context_len: int,
    steps: int,
    rng: np.random.Generator,
    shared: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Aggregate tokens/s of a decode step (the median of ``steps``) for ``batch`` requests at ``context_len``.

    ``shared``: the requests' contexts begin with the same ``context_len - SHARED_TAIL_LEN`` slots."""
    runner, allocator = engine.executor.runner, engine.allocator
    prefix_len = context_len - SHARED_TAIL_LEN if shared else 0
    prefix = allocator.alloc(prefix_len)
    contexts = [allocator.alloc(context_len - prefix_len) for _ in range(batch)]
    assert prefix is not None and all(c is not None for c in contexts), "pool too small"
    ctx: list[np.ndarray] = [np.concatenate([prefix, c]) for c in contexts if c is not None]
    tokens = rng.integers(0, engine.loaded.config.vocab_size, batch)
    runner.forward([StepInput([int(t)], c) for t, c in zip(tokens, ctx)], "decode")  # warm-up
    seconds = []
    for _ in range(steps):
        ctx = [np.concatenate([c, _one_slot(allocator)]) for c in ctx]
        t0 = clock()
        logits = runner.forward([StepInput([int(t)], c) for t, c in zip(tokens, ctx)], "decode")
        seconds.append(clock() - t0)
        tokens = logits.argmax(-1).numpy()
    allocator.free(np.concatenate([prefix, *(c[prefix_len:] for c in ctx)]))
    # The median step: on a shared machine a step that lost its core to another job is an outlier.
    return batch / float(np.median(seconds))


def build(options: dict[str, str], args: argparse.Namespace, batches: list[int]) -> Engine:
    pool_tokens = max(batches) * (args.context + args.decode_steps + 1) + args.context + args.extend_len + 64
    options = {"quantization": "none", **options}  # columns name their weights; not auto's choice per file
    cascade = options.pop("cascade_attention", "on") == "on"  # a model attribute, not an engine option
    engine = Engine.create(model_path=args.model_path, max_total_tokens=pool_tokens, **options)
    engine.loaded.model.cascade_attention = cascade
    return engine


def speeds(engine: Engine, threads: int, args: argparse.Namespace, batches: list[int]) -> dict[str, float]:
    """One round of one column: prefill and each batch's decode tok/s at ``threads``."""
    torch.set_num_threads(threads)
    rng, clock = np.random.default_rng(0), CLOCKS[args.clock]
    found = {"prefill": prefill_tok_s(engine, args.context, rng, clock)}
    found["extend"] = extend_ms(engine, args.context, args.extend_len, rng, clock)
    steps = args.decode_steps
    found.update({f"decode {b}": decode_tok_s(engine, b, args.context, steps, rng, clock=clock) for b in batches})
    for b in shared_batches(batches):
        found[f"shared {b}"] = decode_tok_s(engine, b, args.context, steps, rng, shared=True, clock=clock)
    return found


def measure(
    runs: list[tuple[str, int]], args: argparse.Namespace, batches: list[int], rounds: int
) -> list[dict[str, str]]:
    """Every engine built first, then ``rounds`` rounds over the columns in turn, each cell the best
    round: the machine's load drifts over minutes, and interleaving spreads it over every column."""
    engines = {name: build(COLUMNS[name], args, batches) for name in dict.fromkeys(name for name, _ in runs)}
    best: list[dict[str, float]] = [{} for _ in runs]
    for round_ in range(rounds):
        order = list(zip(best, runs))
        for cells, (name, threads) in order if round_ % 2 == 0 else order[::-1]:  # a load trend hits all alike
            for key, value in speeds(engines[name], threads, args, batches).items():
                best_of = min if key == "extend" else max  # milliseconds, or tokens/s
                cells[key] = best_of(cells.get(key, value), value)
    table = []
    for cells, (name, _) in zip(best, runs):
        info = engines[name].describe()
        row = {"prefill": f"{cells['prefill']:.0f}", "extend": f"{cells['extend']:.0f}"} | {
            f"decode {b}": f"{cells[f'decode {b}']:.1f}" for b in batches
        }
        row.update({f"shared {b}": f"{cells[f'shared {b}']:.1f}" for b in shared_batches(batches)})
        row["ratio"] = f"{cells[f'decode {max(batches)}'] / cells[f'decode {min(batches)}']:.1f}x"
        kv_dtype = info["resolved_kv_cache_dtype"]
        row["dtype"] = f"{info['resolved_dtype']}/{kv_dtype}, {info['resolved_attention_backend']}"
        row["weights"] = f"{weight_bytes(engines[name].loaded.model) / 2**20:.0f} MiB, {info['resolved_quantization']}"
        row["kv"] = f"{info['kv_tokens_per_gib']:,}"
        table.append(row)
    return table


def shared_batches(batches: list[int]) -> list[int]:
    return [b for b in batches if b > 1]  # one request shares with nobody


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
    parser.add_argument("--extend-len", type=int, default=80, help="new tokens of the extend row (on --context)")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the columns; each cell is the best")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"a subset of {','.join(COLUMNS)}")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="thread: CPU time (1 thread only)")
    args = parser.parse_args(argv)
    assert args.clock == "wall" or args.num_threads == "1", "--clock thread counts this thread only"
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
    results = dict(zip(names, measure(runs, args, batches, args.rounds)))
    labels = {"prefill": f"prefill tok/s, {args.context}-token prompt"}
    labels["extend"] = f"extend ms, {args.extend_len} tokens @ {args.context}"
    labels.update({f"decode {b}": f"decode tok/s, batch {b} @ {args.context} ctx" for b in batches})
    shared_len = args.context - SHARED_TAIL_LEN
    labels.update({f"shared {b}": f"  batch {b}, first {shared_len} shared" for b in shared_batches(batches)})
    labels.update(ratio=f"decode batch {max(batches)} / batch {min(batches)}", dtype="dtype / KV dtype, attention")
    labels.update(weights="weights", kv="KV tokens per GiB")
    print(f"{'':<36}" + "".join(f"{name:>26}" for name in names))
    for key, label in labels.items():
        print(f"{label:<36}" + "".join(f"{results[name][key]:>26}" for name in names))


if __name__ == "__main__":
    main()
