"""Weights as GGUF's blocks of 32: Q4_1 for the linears, Q8_0 for the lm_head (``--quantization q4_1``).

Q4_1 stores per block a float16 scale d and min m and 32 4-bit codes (w = d * q + m;
0.625 bytes per weight); Q8_0 a float16 scale and 32 int8 codes (w = d * q; 1.0625 bytes).
A GGUF file's own Q4_1 / Q8_0 blocks are kept exactly as they are (their float32 values
are what the float path runs, so keeping them loses nothing), and so are its Q4_0 blocks (a float16
scale d and 32 4-bit codes, w = d * (q - 8): the Q4_1 kernels with m = -8d, made from d as they read
it, exact; 0.5625 bytes per weight); other weights are
quantized here with gguf's own quantizer. The kernels take and return the model's dtype:
float32 rows multiply by the exact float32 weights; bfloat16 rows (AVX512-BF16) by the exact
Q4 weights in the decode kernel (x . (128 + q) in one vdpbf16ps, then the scale and min: 1.5x the
speed of rounding each weight to bfloat16 first), by the weights rounded to bfloat16 in the GEMM path
and for Q8_0 (as the bfloat16 float model rounds them). With split invariance (the engine's default)
one kernel runs every row count, so a row's result depends on that row only and batch composition and
cache hits change nothing.
Three matmuls, by what the machine offers:

- CPU, up to 16 rows (decode; 48 with int8 activations): our kernel (csrc/block_linear.cpp) reads the blocks
  (bfloat16 calls of 2-32 rows, a verify forward's: csrc/block_bf16_fma.h, the same bits in float32 FMAs);
- CPU, more rows (prefill): csrc/block_gemm.cpp dequantizes a cache-sized tile of output channels at a
  time and runs the dtype's GEMM on it (never a whole float weight per call);
- otherwise (no compiler, CUDA): dequantize with torch ops, then the GEMM.

With ``int8_activations`` (``--quantization q4_1`` on CPU; ``q4_1-exact`` without) each activation
row is first quantized to int8 blocks of 32 and the kernel is csrc/block_q8_linear.cpp, whose
block dot products are integer: lossy against float32 (as llama.cpp). With AVX512-VNNI it is one kernel
for every row count (block_q8_panels.h: decode and prefill at integer-GEMM speed), so split invariance
(model/invariance.py) keeps it for prefill too; without it (or with --no-split-invariant past
INT8_KERNEL_MAX_ROWS) prefill runs the GEMM path on the int8 rows' values: the same math within rounding.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import paged_kernel
from radixserve.model.huge_pages import in_huge_pages

BLOCK = 32
# Up to these rows our block kernels, more: dequantized tiles + the GEMM. Measured on SmolLM2's 30 layers of
# linears (bench block-linears, CPU ms, 1 thread): float activations, kernel vs tiles 73 vs 98 ms at 16 rows,
# 104 vs 124 at 17, 130 vs 112 at 24; int8 activations 123 vs 161 at 32, 192 vs 199 at 48, 263 vs 236 at 64.
KERNEL_MAX_ROWS = 16
INT8_KERNEL_MAX_ROWS = 48
# One tile of dequantized float32 weights (in L3). At 2,048 rows 256 KiB tiles ran 1.26x the whole weight's
# time (MKL packs x again for each tile), 1 MiB tiles 1.00x; at 17-128 rows the two sizes ran alike.
TILE_BYTES = 1024 * 1024
FORMATS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
# The GGUF types whose blocks are kept (read by ``from_gguf``): FORMATS, and Q4_0.
FILE_FORMATS = {**FORMATS, "q4_0": gguf.GGMLQuantizationType.Q4_0}
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q4_0": 18}  # float16 d (and m for Q4_1), then the codes


@dataclass(frozen=True)
class QuantBlocks:
    """One weight [N, K] as blocks of 32 along K. ``qs``: Q4_1 and Q4_0 uint8 [N, K/2] (byte j of a block
    holds weight j in its low nibble and weight j + 16 in its high one), Q8_0 int8 [N, K]; ``d`` and ``m``
    (Q4_1 only; Q4_0 is Q4_1 with m = -8d) float16 [N, K/32]. ``source``: the GGUF type a file stored them
    as, None when quantized here."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    source: str | None = None

    @property
    def fmt(self) -> str:
        if self.qs.dtype == torch.int8:
            return "q8_0"
        return "q4_0" if self.m is None else "q4_1"

    @property
    def bits(self) -> int:
        """4 (Q4_0, Q4_1) or 8 (Q8_0): blocks of one width concatenate (``cat``)."""
        return 8 if self.qs.dtype == torch.int8 else 4

    def mins(self) -> torch.Tensor:
        """Q4_1's m, or Q4_0's -8d as float16 (exact; a d over 8,188 would overflow it: refused)."""
        if self.m is not None:
            return self.m
        m = self.d * -8.0
        if not torch.isfinite(m).all():
            raise ValueError("a Q4_0 scale over 8188 has no float16 min -8d (Q4_1 blocks cannot hold it)")
        return m

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @classmethod
    def from_gguf(cls, raw: np.ndarray, fmt: str, source: str | None = None) -> QuantBlocks:
        """Split GGUF block bytes, uint8 [N, bytes per row], of a FILE_FORMATS type into codes and scales (a
        copy; bit for bit).

        Q4_0: float16 d, then the codes in Q4_1's nibble order; w = d * (q - 8), which the kernels run as Q4_1
        with m = -8d made in float32 as they read d: d * q and -8d are exact, and so is their sum (it fits
        float32's 24 bits), so every value is gguf's own and every kernel has the bits Q4_1 blocks holding
        that m would give."""
        rows = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, _BLOCK_BYTES[fmt])

        def half(at: int) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0])

        if fmt == "q8_0":
            return cls(torch.from_numpy(blocks[..., 2:].reshape(rows, -1).view(np.int8).copy()), half(0), None, source)
        if fmt == "q4_1":
            return cls(torch.from_numpy(blocks[..., 4:].reshape(rows, -1).copy()), half(0), half(2), source)
        return cls(torch.from_numpy(blocks[..., 2:].reshape(rows, -1).copy()), half(0), None, source)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str) -> QuantBlocks:
        """Quantize a float weight [N, K] (K a multiple of 32) with gguf's quantizer."""
        if weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise ValueError(f"{fmt} needs [N, K] weights with K a multiple of {BLOCK}, got {tuple(weight.shape)}")
        raw = gguf.quants.quantize(weight.detach().float().cpu().numpy(), FORMATS[fmt])
        return cls.from_gguf(raw, fmt)

    @classmethod
    def cat(cls, parts: Sequence[QuantBlocks]) -> QuantBlocks:
        """The blocks of the row-wise concatenation of ``parts`` (all of one width: ``bits``); one part is returned
        as is. Q4_0 parts beside Q4_1 ones become Q4_1 (their exact mins, ``mins``)."""
        if len(parts) == 1:
            return parts[0]
        m = None if all(p.m is None for p in parts) else torch.cat([p.mins() for p in parts])
        sources = sorted({p.source for p in parts if p.source is not None})
        return cls(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m, "+".join(sources) or None)

    def to(self, device: torch.device) -> QuantBlocks:
        m = None if self.m is None else self.m.to(device)
        return QuantBlocks(self.qs.to(device), self.d.to(device), m, self.source)

    def select(self, rows: torch.Tensor) -> QuantBlocks:
        """The blocks of the given rows (an embedding lookup)."""
        return QuantBlocks(self.qs[rows], self.d[rows], None if self.m is None else self.m[rows], self.source)

    def dequantize(self) -> torch.Tensor:
        """Float32 [N, K] with torch ops: bit for bit gguf's own dequantization (d * q is exact in float32)."""
        n, k = self.shape
        d = self.d.float()[..., None]
        if self.bits == 8:
            return (self.qs.view(n, -1, BLOCK).float() * d).view(n, k)
        codes = self.qs.view(n, -1, BLOCK // 2)
        q = torch.cat((codes & 0x0F, codes >> 4), dim=-1).float()
        m = d * -8.0 if self.m is None else self.m.float()[..., None]  # Q4_0: d * q - 8d is exactly d * (q - 8)
        return (q * d + m).view(n, k)

    def dequantize_fast(self) -> torch.Tensor:
        """``dequantize()`` through our C++ kernel where it runs (CPU), else torch ops; the same values."""
        if self.qs.device.type == "cpu" and paged_kernel.load():
            out: torch.Tensor = torch.ops.radixserve.block_dequantize(self.qs, self.d, self.m)
            return out
        return self.dequantize()


def kept_blocks(weight: torch.Tensor, parts: Sequence[QuantBlocks | None]) -> QuantBlocks | None:
    """The file's blocks for ``weight`` (the row-wise parts of a fused linear, in order) when every
    part kept blocks and all of one width (Q4_0 and Q4_1 mix, as Q4_1); else None (the caller quantizes
    ``weight``)."""
    found = [p for p in parts if p is not None]
    if not found or len(found) < len(parts) or len({p.bits for p in found}) > 1:
        return None
    blocks = QuantBlocks.cat(found).to(weight.device)
    if blocks.shape != tuple(weight.shape):
        raise ValueError(f"kept blocks of shape {blocks.shape} for a weight of shape {tuple(weight.shape)}")
    return blocks


def tile_columns(in_features: int) -> int:
    """Output channels per dequantized tile: about TILE_BYTES of float32 weights, a multiple of 16 channels, at
    least 64 (a GEMM of a few columns takes another path in MKL, with other bits; see block_gemm.cpp)."""
    return max(64, TILE_BYTES // (4 * in_features) // 16 * 16)


@functools.cache
def choose_bf16_rows_path() -> bool:
    """Whether bfloat16 calls of 2-32 rows run block_bf16_fma.h's float32 FMAs (which reproduce this CPU's
    vdpbf16ps, checked by the op) rather than the instruction: timed here once, both ways alternately on a 9-row
    call (a verify forward's 1 + 8 rows) against 1,536 x 576 Q4_1 weights, best of 5; the faster is kept. The
    bits are the same either way. On the Xeons here vdpbf16ps issues once per two cycles and the FMAs win; a core
    that issues it every cycle keeps it."""
    ops = torch.ops.radixserve
    if not paged_kernel.load() or not ops.block_linear_bf16_fma(True):
        return False
    generator = torch.Generator().manual_seed(0)
    blocks = QuantBlocks.quantize(torch.randn(1536, 576, generator=generator), "q4_1")
    x = torch.randn(9, 576, generator=generator).to(torch.bfloat16)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(5):
        for use in (False, True):
            ops.block_linear_bf16_fma(use)
            began = time.perf_counter()
            ops.block_linear(x, blocks.qs, blocks.d, blocks.m, None, None)
            best[use] = min(best[use], time.perf_counter() - began)
    faster = best[True] < 0.95 * best[False]
    return bool(ops.block_linear_bf16_fma(faster))


class _BlockModule(nn.Module):
    def __init__(self, blocks: QuantBlocks, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.out_features, self.in_features = blocks.shape
        self.qs: torch.Tensor
        self.d: torch.Tensor
        self.m: torch.Tensor | None
        # In huge pages (huge_pages.py): decode streams them every token.
        self.register_buffer("qs", in_huge_pages(blocks.qs))
        self.register_buffer("d", in_huge_pages(blocks.d))
        self.register_buffer("m", None if blocks.m is None else in_huge_pages(blocks.m))

    @property
    def blocks(self) -> QuantBlocks:
        return QuantBlocks(self.qs, self.d, self.m)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [T, K] as int8 blocks of 32, as block_q8_linear.cpp makes them: codes int8 [T, K] =
    round-half-even(x * (127 / max|x|)) and scales float32 [T, K / 32] = max|x| / 127 (both float32 ops)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    return torch.round(xb * inv).to(torch.int8).reshape(x.shape), (top / 127).squeeze(-1)


def int8_activation_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The int8-activation kernel's math with torch ops (no compiler): x's codes times their scales (exact in
    float32) against the dequantized ``weight``. Equal to the kernel within float rounding."""
    codes, scales = quantize_activations(x)
    x_hat = (codes.view(x.shape[0], -1, BLOCK).float() * scales[..., None]).view(x.shape)
    return F.linear(x_hat.to(weight.dtype), weight)


def dequantized_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, int8_activations: bool
) -> torch.Tensor:
    """The linear on the dequantized ``weight`` (x's dtype) with torch ops, as the kernels' math where they cannot
    run: float activations, or (CPU) int8 ones (``int8_activation_linear``; CUDA: nothing to gain from int8 rows)."""
    if not int8_activations or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    out = int8_activation_linear(x, weight)
    return out if bias is None else out + bias


class BlockLinear(_BlockModule):
    """A drop-in for ``nn.Linear`` (x [T, K] -> [T, N]) over Q4_1 or Q8_0 blocks.

    ``int8_activations`` (CPU): each activation row is quantized to int8 blocks of 32 first and the block
    dot products are integer (as llama.cpp runs these formats): ~1.4x faster decode kernel; on SmolLM2
    top-1 agreement 0.97-0.98 and mean KL 4e-3 against float32 (bfloat16 weights: 0.983, 1.4e-3).
    False, or on CUDA: float activations, equal to float32 on the dequantized weights."""

    def __init__(
        self, blocks: QuantBlocks, bias: torch.Tensor | None, dtype: torch.dtype, int8_activations: bool = False
    ) -> None:
        super().__init__(blocks, dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.int8_activations = int8_activations
        # Every row count through one kernel whose result for a row never depends on the other rows of the call
        # (model/invariance.py): the GEMM path's (oneDNN, MKL) does, so a cache hit, which changes how many rows a
        # prompt's tail is computed with, changed answers. "vector": the decode kernel; "amx": block_amx.cpp
        # (bfloat16 rows on AMX tiles; int8 activations keep their kernel); None: the decode kernel up to its rows,
        # the tiled GEMM past them.
        self.invariant_kernel: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or not paged_kernel.load():
            return self._torch_forward(x)
        if self._kernel_takes(x):
            return self._kernel(x, None)
        # Many rows (prefill): the dtype's own GEMM, a cache-sized tile of dequantized weights at a time; each
        # row's result depends on that row alone (with float rows, bit for bit F.linear on the float weights).
        rows = torch.ops.radixserve.dequantized_rows_q8(x).to(x.dtype) if self.int8_activations else x
        tile = tile_columns(self.in_features)
        tiled: torch.Tensor = torch.ops.radixserve.block_linear_tiled(rows, self.qs, self.d, self.m, self.bias, tile)
        return tiled

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, overwrite_residual: bool = False) -> torch.Tensor:
        """residual + self(x) with the add inside the matmul. The tiled path adds the residual inside the GEMM
        (addmm) as the float model does: MKL adds C before its last pass over K, so residual + mm would differ
        from float32 in the last bit (K >= 576). The kernel adds it to each float32 sum (no pass over [T, N])
        as its many-row path adds it: before the one rounding to x's dtype, or with int8 activations (whose
        tiled path runs residual + self(x)) after rounding, then rounded again.

        ``overwrite_residual``: the caller no longer needs ``residual`` (a decoder layer's hidden state), so the
        tiled path may add into it in place (the same GEMMs and bits, without copying it into each tile's output
        first) and return it. Otherwise ``residual`` is never written."""
        if x.device.type != "cpu" or not paged_kernel.load():
            out: torch.Tensor = residual + self(x)
            return out
        if self._kernel_takes(x):
            return self._kernel(x, residual.contiguous())
        if self.int8_activations or self.bias is not None:
            out = residual + self(x)
            return out
        tile = tile_columns(self.in_features)
        if overwrite_residual and residual.is_contiguous() and residual.dtype == x.dtype:
            added: torch.Tensor = torch.ops.radixserve.block_linear_tiled_add_(
                residual, x, self.qs, self.d, self.m, tile
            )
            return added
        added = torch.ops.radixserve.block_linear_tiled(x, self.qs, self.d, self.m, residual, tile)
        return added

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the decode kernel runs these rows: up to its row count, or any count when split-invariant."""
        if self.invariant_kernel is not None:
            return True
        return x.shape[0] <= (INT8_KERNEL_MAX_ROWS if self.int8_activations else KERNEL_MAX_ROWS)

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The decode kernel: x @ W.T + bias (+ residual) in x's dtype, summed in float32 (see forward_add)."""
        ops = torch.ops.radixserve  # each op's overload itself (.default): no overload resolution per call
        op = ops.block_linear_q8.default if self.int8_activations else ops.block_linear.default
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.invariant_kernel == "amx" and x.dtype == torch.bfloat16 and not self.int8_activations:
            op = ops.block_linear_amx.default
        elif x.shape[0] > 1 and x.dtype == torch.bfloat16:
            choose_bf16_rows_path()  # timed at the first such call in the process, then cached
        out: torch.Tensor = op(x, self.qs, self.d, self.m, bias, residual)
        return out

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """No kernel (no compiler), or CUDA: dequantize with torch ops, then the dtype's GEMM."""
        return dequantized_linear(x, self.blocks.dequantize().to(x.dtype), self.bias, self.int8_activations)


class BlockEmbedding(_BlockModule):
    """A drop-in for ``nn.Embedding`` over blocks: a lookup dequantizes only the rows it reads."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # dequantize_fast: one kernel call, the values of dequantize's ~6 torch ops (a decode step looks up one row)
        rows = self.blocks.select(ids.reshape(-1)).dequantize_fast()
        return rows.view(*ids.shape, self.in_features).to(self.dtype)
