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

``--formats`` times GGUF row types instead (gguf_rows.py: q4_k, q5_k, q6_k, q5_0, q5_1, f16, bf16, f32): random
valid rows (``random_rows``) of each fused linear's shape whose width holds whole blocks of the type (the
K-quants' 256: only down_proj's 1,536 on SmolLM2), through gguf_rows_linear.cpp's ``kernel`` and ``tiled``
(and ``dequant``, ``gemm``, ``whole``; ``kernel-q8``: gguf_rows_q8_linear.cpp, int8 activations); ``file`` is
the model's own blocks, as without the flag. Each table is followed by its cells as ns per weight and GB/s of
weight bytes read.

At one thread the figures are this thread's CPU time (time spent waiting for a core shared with other
jobs is left out; cache and memory bandwidth they take is not): read one run's columns side by side.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import paged_kernel
from radixserve.model.gguf_loader import default_model_path, load_gguf_blocks, read_gguf_config
from radixserve.model.gguf_rows import ROW_TYPES, GGUFRows
from radixserve.model.kept_weights import FUSED_PARTS
from radixserve.model.quant_blocks import QuantBlocks, tile_columns

# (the blocks or rows, their float32 values made once, x) -> the output
Path = Callable[[Any, torch.Tensor, torch.Tensor], object]
Weights = list[tuple[Any, torch.Tensor]]
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


ROW_PATHS: dict[str, Path] = {
    "dequant": lambda w, wf, x: w.dequantize(),
    "gemm": lambda w, wf, x: F.linear(x, wf),
    "whole": lambda w, wf, x: F.linear(x, w.dequantize().to(x.dtype)),
    "tiled": lambda w, wf, x: ops.gguf_rows_linear_tiled(
        x, w.raw, w.type_id, w.in_features, None, tile_columns(w.in_features)
    ),
    "kernel": lambda w, wf, x: ops.gguf_rows_linear(x, w.raw, w.type_id, w.in_features),
    "kernel-q8": lambda w, wf, x: ops.gguf_rows_linear_q8(x, w.raw, w.type_id, w.in_features),
}
# Where each row type keeps float16 scales (byte offsets in a block), set to sane values by random_rows.
_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}


def random_rows(qtype: str, out_features: int, in_features: int, seed: int) -> GGUFRows:
    """Valid random rows of a GGUF row type: random code bytes with every float16 scale (and min) at
    +-10^U(-3, -1); the float types random normal values."""
    rng = np.random.default_rng(seed)
    if qtype not in _SCALE_OFFSETS:
        values = torch.from_numpy(rng.standard_normal((out_features, in_features)).astype(np.float32))
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[qtype]
        return GGUFRows(values.to(dtype).view(torch.uint8).clone(), qtype, in_features)
    weights, nbytes = gguf.GGML_QUANT_SIZES[ROW_TYPES[qtype]]
    blocks = rng.integers(0, 256, (out_features, in_features // weights, nbytes), dtype=np.uint8)
    for at in _SCALE_OFFSETS[qtype]:
        scale = 10 ** rng.uniform(-3, -1, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2])
        blocks[..., at : at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return GGUFRows(torch.from_numpy(blocks.reshape(out_features, -1)), qtype, in_features)


def row_weights(model_path: str, layers: int, qtype: str) -> Weights:
    """Random rows of ``qtype`` for the first ``layers`` layers' fused linears whose width holds whole blocks."""
    block = gguf.GGML_QUANT_SIZES[ROW_TYPES[qtype]][0]
    fused = []
    for i, (w, _) in enumerate(layer_weights(model_path, layers)):
        n, k = w.shape
        if k % block == 0:
            rows = random_rows(qtype, n, k, seed=i)
            fused.append((rows, rows.dequantize()))
    if not fused:
        raise SystemExit(f"no linear of this model holds whole {qtype} blocks of {block}")
    return fused


def weight_bytes(w: Any) -> int:
    if isinstance(w, GGUFRows):
        return w.raw.numel()
    return sum(t.numel() * t.element_size() for t in (w.qs, w.d, w.m) if t is not None)


def layer_weights(model_path: str, layers: int) -> list[tuple[QuantBlocks, torch.Tensor]]:
    """The first ``layers`` layers' fused linears as the model holds them (the file must keep them all)."""
    blocks = load_gguf_blocks(model_path)
    fused = []
    for i in range(layers):
        for parts in FUSED_PARTS.values():
            found = [blocks[f"model.layers.{i}.{part}.weight"] for part in parts]
            if not all(isinstance(b, QuantBlocks) for b in found):  # rows of another type: not these kernels
                raise ValueError(f"{model_path}: layer {i}'s linears are not all Q4_0 / Q4_1 / Q8_0 blocks")
            w = QuantBlocks.cat([b for b in found if isinstance(b, QuantBlocks)])
            fused.append((w, w.dequantize_fast()))
    return fused


def forward_ms(path: Path, weights: Weights, inputs: dict[int, torch.Tensor], scale: float) -> float:
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
    parser.add_argument("--formats", default="file", help=f"file (the model's blocks) or of {','.join(ROW_TYPES)}")
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
    layers = min(args.layers, num_layers)
    dtype = getattr(torch, args.dtype)
    runs_amx = args.dtype == "bfloat16" and bool(ops.amx_available())
    names = args.paths.split(",") if args.paths else [name for name in PATHS if name != "amx" or runs_amx]
    formats: dict[str, tuple[Weights, dict[str, Path]]] = {}
    for fmt in args.formats.split(","):
        if fmt == "file":
            weights: Weights = list(layer_weights(model_path, layers))
            paths = {n: tiled(int(n[6:])) if n.startswith("tiled@") else PATHS[n] for n in names}
        else:
            weights = row_weights(model_path, layers, fmt.upper())
            paths = {n: ROW_PATHS[n] for n in names if n in ROW_PATHS}
        formats[fmt] = [(w, wf.to(dtype)) for w, wf in weights], paths
    best = time_cells(formats, args, num_layers / layers)
    for fmt, (weights, paths) in formats.items():
        cells = {(r, n): ms for (f, r, n), ms in best.items() if f == fmt}
        print_table(fmt, weights, paths, cells, args, (num_layers, layers))


def time_cells(
    formats: dict[str, tuple[Weights, dict[str, Path]]], args: argparse.Namespace, scale: float
) -> dict[tuple[str, int, str], float]:
    """Best ms per forward by (format, rows, path); each round runs every format's paths, in turn reversed, so a
    change in the machine's load falls on all of them alike."""
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    best: dict[tuple[str, int, str], float] = {}
    widths = {w.shape[1] for weights, _ in formats.values() for w, _ in weights}
    cells = [(fmt, name, path) for fmt, (_, paths) in formats.items() for name, path in paths.items()]
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in widths}
        for round_ in range(args.rounds):
            for fmt, name, path in cells if round_ % 2 == 0 else cells[::-1]:
                ms = forward_ms(path, formats[fmt][0], inputs, scale)
                best[fmt, rows, name] = min(best.get((fmt, rows, name), float("inf")), ms)
    return best


def print_table(
    fmt: str,
    weights: Weights,
    paths: dict[str, Path],
    best: dict[tuple[int, str], float],
    args: argparse.Namespace,
    model_layers: tuple[int, int],
) -> None:
    """One format's table (of ``model_layers``: the model's layers, those timed): ms per forward by rows and path,
    then the same cells as ns per weight (GB/s of the weights' bytes)."""
    num_layers, layers = model_layers
    scale = num_layers / layers
    clock = "CPU" if args.num_threads == 1 else "wall"
    kind = "" if fmt == "file" else f" ({fmt}: {len(weights) // layers} a layer)"
    print(
        f"{clock} ms per forward, {num_layers} layers' linears{kind}, {args.dtype} x, {args.num_threads} thread(s), "
        f"best of {args.rounds}"
    )
    print(f"{'rows':>6}" + "".join(f"{name:>12}" for name in paths))
    for rows in dict.fromkeys(r for r, _ in best):
        print(f"{rows:>6}" + "".join(f"{best[rows, name]:>12.1f}" for name in paths))
    numel = sum(w.shape[0] * w.shape[1] for w, _ in weights) * scale
    nbytes = sum(weight_bytes(w) for w, _ in weights) * scale
    print(f"ns per weight (GB/s of {nbytes / numel:.4g} bytes a weight)")
    for rows in dict.fromkeys(r for r, _ in best):
        cells = (f"{best[rows, n] * 1e6 / numel:.4f} ({nbytes / best[rows, n] / 1e6:.1f})" for n in paths)
        print(f"{rows:>6}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
