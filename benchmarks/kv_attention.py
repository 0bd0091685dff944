"""The attention kernels alone on a float32, a bfloat16 and an 8-bit KV pool: ``radixserve bench kv-attention``.

SmolLM2's shape (9 query heads over 3 K/V heads of 64 dims, ``--layers`` layers of pool): decode at
``--batch`` requests of ``--context`` tokens each in slots of their own (the paged kernel, every layer in
turn, so the pools' bytes stream from memory as in a model step), and one cold prefill of ``--context``
tokens (one layer: the extend kernel where the CPU has AVX512-BF16 and the pool is not float32, else the paged
kernel, as a model step routes it). q is float32 against the float32 pool (the model's dtype there), bfloat16
against the others. The pools hold the same random K/V; the columns run in turn, ``--rounds`` times, each cell
the best round.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.model_speed import CLOCKS
from radixserve.memory.kv_pool import KVPool
from radixserve.model import paged_kernel
from radixserve.model.attention import extend_kernel_usable
from radixserve.model.paged_kernel import PagedIndex, extend_attention, paged_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def pools(layers: int, num_slots: int) -> dict[str, KVPool]:
    generator = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, num_slots, KV_HEADS, HEAD_DIM, generator=generator)
    made = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        pool = KVPool(layers, num_slots, KV_HEADS, HEAD_DIM, dtype)
        for layer in range(layers):
            pool.write(layer, torch.arange(num_slots), k, v)
        made[name] = pool
    return made


def scales(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    return (pool.k_scale[layer], pool.v_scale[layer]) if pool.quantized else None


def seconds(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench kv-attention", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="thread: CPU time (1 thread only)")
    args = parser.parse_args(argv)
    assert args.clock == "wall" or args.num_threads == 1, "--clock thread counts this thread only"
    clock = CLOCKS[args.clock]
    assert paged_kernel.load(), "the C++ kernels did not build"
    torch.set_num_threads(args.num_threads)
    span = args.context + 1
    made = pools(args.layers, args.batch * span + 1)
    contexts = [torch.arange(1 + b * span, 1 + (b + 1) * span) for b in range(args.batch)]
    decode = PagedIndex.build(contexts, [1] * args.batch, cascade=False)
    prefill = PagedIndex.build([contexts[0][: args.context]], [args.context], cascade=False)
    q_decode = torch.randn(args.batch, HEADS, HEAD_DIM)
    q_prefill = torch.randn(args.context, HEADS, HEAD_DIM)
    extend = extend_kernel_usable()
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for name, pool in made.items():
            dtype = torch.float32 if name == "float32" else torch.bfloat16
            qd, qp = q_decode.to(dtype), q_prefill.to(dtype)
            step = seconds(
                lambda p=pool, q=qd: [  # type: ignore[misc]
                    paged_attention(q, p.k[i], p.v[i], decode, scales=scales(p, i)) for i in range(args.layers)
                ],
                clock,
            )
            kernel = extend_attention if extend and name != "float32" else paged_attention
            cold = seconds(
                lambda p=pool, q=qp, f=kernel: f(q, p.k[0], p.v[0], prefill, scales=scales(p, 0)),  # type: ignore[misc]
                clock,
            )
            for kind, value in (("decode", step / args.layers), ("prefill", cold)):
                best[(kind, name)] = min(best.get((kind, name), value), value)
    print(f"{args.num_threads} thread(s); ms ({args.clock} clock), best of {args.rounds}")
    print(f"{'':<44}{'float32':>10}{'bfloat16':>10}{'int8':>10}{'bf16/int8':>10}")
    rows = {
        "decode": f"decode, batch {args.batch} @ {args.context}, per layer",
        "prefill": f"prefill attention, {args.context} tokens, one layer",
    }
    for kind, label in rows.items():
        f32, bf16, int8 = (best[(kind, name)] * 1e3 for name in made)
        print(f"{label:<44}{f32:>10.2f}{bf16:>10.2f}{int8:>10.2f}{bf16 / int8:>9.2f}x")


if __name__ == "__main__":
    main()
