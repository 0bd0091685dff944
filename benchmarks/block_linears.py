"""A forward's block linears alone, by row count: ``radixserve bench block-linears``.

The embedded SmolLM2 GGUF's own Q4_1 blocks (or ``--model-path``), fused per layer as the model runs
them (q|k|v, o, gate|up, down), each path timed over ``--layers`` layers and scaled to the model's
layer count: ms per forward. Paths, interleaved round by round in one process (each cell the best round):

- ``dequant``: every weight dequantized whole (C++), once per call: what more than 16 rows paid before;
- ``gemm``: the dtype's GEMM on those float weights (the float model's own linears; ``--dtype``: x's and theirs);
- ``whole``: the two together, the many-row path before block_gemm.cpp;
- ``tiled``: block_gemm.cpp, a cache-sized tile of dequantized weights at a time (``tiled@K`` for K KiB tiles);
- ``kernel``: block_linear.cpp (float activations) over all rows;
- ``kernel-q8``: block_q8_linear.cpp (int8 activations) over all rows;
- ``amx``: block_amx.cpp (bfloat16 x only, AMX-BF16 CPUs) over all rows, a row's bits independent of the row count;
- ``tiled-q8``: the int8 rows' values (dequantized_rows_q8) through the tiled GEMM.

At one thread the figures are this thread's CPU time (time spent waiting for a core shared with other
jobs is left out; cache and memory bandwidth they take is not): read one run's columns side by side.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.model import paged_kernel
from radixserve.model.gguf_loader import default_model_path, load_gguf_blocks, read_gguf_config
from radixserve.model.llama import FUSED_PARTS
from radixserve.model.quant_blocks import QuantBlocks, tile_columns

# (the blocks, their float32 values made once, x) -> the output
Path = Callable[[QuantBlocks, torch.Tensor, torch.Tensor], object]
ops = torch.ops.radixserve


def tiled(tile_kib: int | None) -> Path:
    def run(w: QuantBlocks, _: torch.Tensor, x: torch.Tensor) -> object:
        in_features = w.shape[1]
        tile = tile_columns(in_features) if tile_kib is None else max(16, tile_kib * 256 // in_features // 16 * 16)
        return ops.block_linear_tiled(x, w.qs, w.d, w.m, None, tile)

    return run


PATHS: dict[str, Path] = {
    "dequant": lambda w, wf, x: w.dequantize_fast(),
    "gemm": lambda w, wf, x: F.linear(x, wf),
    "whole": lambda w, wf, x: F.linear(x, w.dequantize_fast().to(x.dtype)),
    "tiled": tiled(None),
    "kernel": lambda w, wf, x: ops.block_linear(x, w.qs, w.d, w.m),
    "kernel-q8": lambda w, wf, x: ops.block_linear_q8(x, w.qs, w.d, w.m),
    "amx": lambda w, wf, x: ops.block_linear_amx(x, w.qs, w.d, w.m),
    "tiled-q8": lambda w, wf, x: tiled(None)(w, wf, ops.dequantized_rows_q8(x)),
}


def layer_weights(model_path: str, layers: int) -> list[tuple[QuantBlocks, torch.Tensor]]:
    """The first ``layers`` layers' fused linears as the model holds them (the file must keep them all)."""
    blocks = load_gguf_blocks(model_path)
    fused = []
    for i in range(layers):
        for parts in FUSED_PARTS.values():
            w = QuantBlocks.cat([blocks[f"model.layers.{i}.{part}.weight"] for part in parts])
            fused.append((w, w.dequantize_fast()))
    return fused


def forward_ms(
    path: Path, weights: list[tuple[QuantBlocks, torch.Tensor]], inputs: dict[int, torch.Tensor], scale: float
) -> float:
    # One thread: this thread's CPU time, so time the core spent on other jobs does not count (on a shared
    # machine wall time swung 2x between rounds); more threads: wall time.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t0 = clock()
    for w, wf in weights:
        path(w, wf, inputs[w.shape[1]])
    return (clock() - t0) * 1000 * scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench block-linears", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="a GGUF whose linears are Q4_1/Q8_0 (default: SmolLM2)")
    parser.add_argument("--rows", default="16,17,32,80,128,512,2048")
    parser.add_argument("--paths", default=None, help=f"of {','.join(PATHS)}, and tiled@KiB (default: all that run)")
    parser.add_argument("--layers", type=int, default=30, help="layers timed (scaled to the model's count)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of x (and gemm's weights)")
    args = parser.parse_args(argv)
    if not paged_kernel.load():
        raise SystemExit("the block kernels did not build (see the log)")
    torch.set_num_threads(args.num_threads)
    model_path = args.model_path or default_model_path()
    num_layers = read_gguf_config(model_path).num_layers
    dtype = getattr(torch, args.dtype)
    weights = [(w, wf.to(dtype)) for w, wf in layer_weights(model_path, min(args.layers, num_layers))]
    scale = num_layers / min(args.layers, num_layers)
    runs_amx = args.dtype == "bfloat16" and bool(ops.amx_available())
    names = args.paths.split(",") if args.paths else [name for name in PATHS if name != "amx" or runs_amx]
    paths = {name: tiled(int(name[6:])) if name.startswith("tiled@") else PATHS[name] for name in names}
    generator = torch.Generator().manual_seed(0)
    best: dict[tuple[int, str], float] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in {w.shape[1] for w, _ in weights}}
        for round_ in range(args.rounds):
            order = list(paths.items())
            for name, path in order if round_ % 2 == 0 else order[::-1]:
                ms = forward_ms(path, weights, inputs, scale)
                best[rows, name] = min(best.get((rows, name), float("inf")), ms)
    clock = "CPU" if args.num_threads == 1 else "wall"
    print(
        f"{clock} ms per forward, {num_layers} layers' linears, {args.dtype} x, {args.num_threads} thread(s), "
        f"best of {args.rounds}"
    )
    print(f"{'rows':>6}" + "".join(f"{name:>12}" for name in paths))
    for rows in dict.fromkeys(r for r, _ in best):
        print(f"{rows:>6}" + "".join(f"{best[rows, name]:>12.1f}" for name in paths))


if __name__ == "__main__":
    main()
