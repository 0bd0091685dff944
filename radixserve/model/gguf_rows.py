"""Weights kept as a GGUF file stores them, row by row: the K-quants (Q4_K, Q5_K, Q6_K), Q5_0 / Q5_1 and the
float types (F16, BF16, F32), run by the CPU kernels of csrc/gguf_rows_linear.cpp straight from the file's bytes.

Each output row of a weight [N, K] is the file's bytes of that row, unchanged: ``raw`` uint8 [N, row bytes]
(K-quants: super-blocks of 256 weights, 144 / 176 / 210 bytes; Q5_0 / Q5_1 blocks of 32, 22 / 24 bytes; F16 and
BF16 2 bytes a weight, F32 4). So the memory the weights take is the file's tensor bytes. Every value a kernel
multiplies by is gguf's own ``dequantize`` of those bytes (float32; bfloat16 activations: those values rounded to
bfloat16, as the GEMM path rounds them). Q4_0 / Q4_1 / Q8_0 have their own path (quant_blocks.py). As there,
three matmuls by what the machine offers:

- CPU, up to KERNEL_MAX_ROWS rows (float32 x: FLOAT32_KERNEL_MAX_ROWS; decode): the decode kernel reads each row's
  bytes once (csrc/gguf_rows.h decodes them in registers); a row's result is bitwise the same alone or in any batch;
- CPU, more rows (prefill): a cache-sized tile of output channels dequantized into x's dtype at a time, then the
  dtype's GEMM (csrc/tiled_gemm.h): bit for bit F.linear on the dequantized weight;
- otherwise (no compiler, CUDA): gguf's dequantize, then the GEMM.

With ``int8_activations`` (``--quantization q4_1``) the types with codes (INT8_ROW_TYPES) run
csrc/gguf_rows_q8_linear.cpp instead: each activation row quantized to int8 blocks of 32 (as the Q4_0 / Q8_0 path,
quant_blocks.py), each block's dot with the weights' codes exact integer arithmetic, as llama.cpp multiplies them
(AVX512-VNNI: block_q8_panels.h at every row count; AVX2: csrc/gguf_rows_q8_avx2.h, vpmaddubsw as llama.cpp;
elsewhere a portable loop with the same math). The float types keep float activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from radixserve.model import paged_kernel
from radixserve.model.huge_pages import in_huge_pages
from radixserve.model.quant_blocks import INT8_KERNEL_MAX_ROWS, dequantized_linear, tile_columns

# The GGUF types kept as rows, and each one's (weights, bytes) per block (gguf.GGML_QUANT_SIZES).
ROW_TYPES = {
    name: gguf.GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "F16", "BF16", "F32")
}
# Up to these rows the decode kernel, more: dequantized tiles + the GEMM. Measured on SmolLM2's linears (bench
# block-linears --formats, CPU ms per forward, 1 thread), kernel vs tiles: bfloat16 x (whose GEMM is fast) Q5_0 73 vs 91
# at 20 rows, 82 vs 80 at 24; Q4_K 16 vs 17 at 20, 19 vs 17 at 24; float32 x Q5_0 139 vs 148 at 48, 158 vs 150 at 56,
# Q6_K and F16 still ahead at 56.
KERNEL_MAX_ROWS = 20
FLOAT32_KERNEL_MAX_ROWS = 48
# The types whose rows are small integer codes with scales (and mins) per block: they can run int8 activations.
INT8_ROW_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


def int8_rows_pay() -> bool:
    """Whether a model asked for int8 activations (``--quantization q4_1``) runs them on its INT8_ROW_TYPES rows: only
    where the int8 rows kernel has a SIMD path (AVX512-VNNI panels, or AVX2: every one of the five types; on a Zen 3,
    Q4_K_M decodes at 55 tok/s int8 against 39 float). Without AVX2 that kernel is a portable loop, 6x slower
    than the float rows' kernel (Q4_K_M: 5.7 tok/s against 36.7 when the Zen 3 had no AVX2 path), so those rows keep
    float activations (and the model's quantization detail says so); Q4_0 / Q4_1 / Q8_0 blocks run int8 everywhere."""
    return not paged_kernel.load() or bool(torch.ops.radixserve.gguf_rows_q8_simd())


def kernel_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which x of ``dtype`` runs the decode kernel (KERNEL_MAX_ROWS, float32 FLOAT32_KERNEL_MAX_ROWS)."""
    return FLOAT32_KERNEL_MAX_ROWS if dtype == torch.float32 else KERNEL_MAX_ROWS


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights stored as ``qtype`` (a multiple of its block)."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[ROW_TYPES[qtype]]
    if in_features % weights:
        raise ValueError(f"{qtype} stores rows of whole blocks of {weights} weights, not {in_features}")
    return in_features // weights * nbytes


@dataclass(frozen=True)
class GGUFRows:
    """One weight [N, K] as a GGUF file stores it: ``raw`` uint8 [N, row_bytes(qtype, K)] (see the module)."""

    raw: torch.Tensor
    qtype: str
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in ROW_TYPES:
            raise ValueError(f"GGUF type {self.qtype} is not kept as rows (kept: {sorted(ROW_TYPES)})")
        expected = row_bytes(self.qtype, self.in_features)
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2 or self.raw.shape[1] != expected:
            raise ValueError(f"{self.qtype} rows of {self.in_features} weights are uint8 [N, {expected}]")

    @property
    def source(self) -> str:
        """The GGUF type the file stored (as ``QuantBlocks.source``)."""
        return self.qtype

    @property
    def fmt(self) -> str:
        return self.qtype.lower()

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.in_features

    @classmethod
    def from_gguf(cls, data: np.ndarray, qtype: str) -> GGUFRows:
        """A tensor's data as gguf's reader gives it (uint8 [N, row bytes] for the quantized types, float
        [N, K] for F16 / F32, uint16-like for BF16), copied into its own memory as bytes."""
        rows = np.ascontiguousarray(data).reshape(data.shape[0], -1).view(np.uint8)
        weights, nbytes = gguf.GGML_QUANT_SIZES[ROW_TYPES[qtype]]
        return cls(torch.from_numpy(rows.copy()), qtype, rows.shape[1] // nbytes * weights)

    @classmethod
    def cat(cls, parts: Sequence[GGUFRows]) -> GGUFRows:
        """The rows of the row-wise concatenation of ``parts`` (all of one type and width)."""
        if len(parts) == 1:
            return parts[0]
        if len({(p.qtype, p.in_features) for p in parts}) != 1:
            raise ValueError("GGUFRows.cat: parts of one type and width only")
        return cls(torch.cat([p.raw for p in parts]), parts[0].qtype, parts[0].in_features)

    def to(self, device: torch.device) -> GGUFRows:
        return GGUFRows(self.raw.to(device), self.qtype, self.in_features)

    def select(self, rows: torch.Tensor) -> GGUFRows:
        """The given rows (an embedding lookup)."""
        return GGUFRows(self.raw[rows.reshape(-1)], self.qtype, self.in_features)

    @property
    def type_id(self) -> int:
        """gguf's number for the type (the kernels' ``qtype``)."""
        return int(ROW_TYPES[self.qtype])

    def dequantize(self) -> torch.Tensor:
        """Float32 [N, K]: gguf's own dequantization, bit for bit (our kernel on CPU where it builds, else gguf-py)."""
        if self.raw.device.type == "cpu" and paged_kernel.load():
            out: torch.Tensor = torch.ops.radixserve.gguf_rows_dequantize(self.raw, self.type_id, self.in_features)
            return out
        raw = self.raw.cpu().numpy()
        if self.qtype in ("F16", "F32"):
            values = raw.view(np.float16 if self.qtype == "F16" else np.float32).astype(np.float32)
        else:
            values = gguf.quants.dequantize(raw, ROW_TYPES[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.raw.device)


class _RowsModule(nn.Module):
    def __init__(self, rows: GGUFRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.qtype = rows.qtype
        self.out_features, self.in_features = rows.shape
        self.raw: torch.Tensor
        # Decode streams the quantized rows every token: in huge pages (huge_pages.py). Float rows may be a view of
        # a tensor that stays (model/invariance.py reads a float model's weights in place): left where they are.
        self.register_buffer("raw", in_huge_pages(rows.raw) if rows.qtype in INT8_ROW_TYPES else rows.raw)

    @property
    def rows(self) -> GGUFRows:
        return GGUFRows(self.raw, self.qtype, self.in_features)


class GGUFRowsLinear(_RowsModule):
    """A drop-in for ``nn.Linear`` (x [T, K] -> [T, N], x's dtype) over a file's rows.

    ``int8_activations`` (CPU, INT8_ROW_TYPES only; the float types ignore it): each activation row quantized to
    int8 blocks of 32 and integer block dot products (module docstring). Else float activations: every value
    multiplied is gguf's dequantized weight."""

    def __init__(
        self, rows: GGUFRows, bias: torch.Tensor | None, dtype: torch.dtype, int8_activations: bool = False
    ) -> None:
        super().__init__(rows, dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.int8_activations = int8_activations and rows.qtype in INT8_ROW_TYPES
        self.type_id = rows.type_id  # read once, not through a GGUFRows (validated) made per call
        # Not None: every row count through the decode kernel (model/invariance.py; the rows have no AMX kernel, so
        # "amx" runs it too), a row's bits then never depending on the other rows of the call.
        self.invariant_kernel: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or not paged_kernel.load():
            return self._torch_forward(x)
        if self._kernel_takes(x):
            return self._kernel(x, None)
        args = (self.raw, self.type_id, self.in_features, self.bias, tile_columns(self.in_features))
        if self.int8_activations:  # the GEMM on the int8 rows' values: the kernel's math within rounding
            x = torch.ops.radixserve.dequantized_rows_q8(x).to(x.dtype)
        out: torch.Tensor = torch.ops.radixserve.gguf_rows_linear_tiled(x, *args)
        return out

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, overwrite_residual: bool = False) -> torch.Tensor:
        """residual + self(x) with the add inside the matmul, as ``BlockLinear.forward_add``: the kernel adds it to
        each float32 sum before the one rounding to x's dtype (int8 activations: after it, then rounds again), the
        tiled path inside the GEMM (addmm, as the float model adds it). ``overwrite_residual``: the caller no longer
        needs ``residual``, so the tiled path may add into it in place and return it; otherwise ``residual`` is
        never written."""
        if x.device.type != "cpu" or not paged_kernel.load():
            out: torch.Tensor = residual + self(x)
            return out
        if self._kernel_takes(x):
            return self._kernel(x, residual.contiguous())
        if self.bias is not None or self.int8_activations:
            out = residual + self(x)
            return out
        args = (self.raw, self.type_id, self.in_features)
        tile = tile_columns(self.in_features)
        if overwrite_residual and residual.is_contiguous() and residual.dtype == x.dtype:
            added: torch.Tensor = torch.ops.radixserve.gguf_rows_linear_tiled_add_(residual, x, *args, tile)
            return added
        added = torch.ops.radixserve.gguf_rows_linear_tiled(x, *args, residual, tile)
        return added

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the decode kernel runs these rows: up to its row count, or any count when split-invariant."""
        if self.invariant_kernel is not None:
            return True
        return x.shape[0] <= (INT8_KERNEL_MAX_ROWS if self.int8_activations else kernel_max_rows(x.dtype))

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The decode kernel: x @ W.T + bias (+ residual) in x's dtype, summed in float32."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        ops = torch.ops.radixserve
        op = ops.gguf_rows_linear_q8.default if self.int8_activations else ops.gguf_rows_linear.default
        out: torch.Tensor = op(x, self.raw, self.type_id, self.in_features, bias, residual)
        return out

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """No kernel (no compiler), or CUDA: gguf's dequantize, then the dtype's GEMM (int8 activations on CPU: the
        kernel's math with torch ops)."""
        return dequantized_linear(x, self.rows.dequantize().to(x.dtype), self.bias, self.int8_activations)


class GGUFRowsEmbedding(_RowsModule):
    """A drop-in for ``nn.Embedding`` over a file's rows: a lookup dequantizes only the rows it reads."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.select(ids).dequantize().view(*ids.shape, self.in_features).to(self.dtype)
