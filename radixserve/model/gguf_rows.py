"""Weights kept as a GGUF file stores them, row by row: the K-quants (Q4_K, Q5_K, Q6_K), Q5_0 / Q5_1 and the
float types (F16, BF16, F32), run by the CPU kernels of csrc/gguf_rows*.cpp straight from the file's bytes.

Each output row of a weight [N, K] is the file's bytes of that row, unchanged: ``raw`` uint8 [N, row bytes]
(K-quants: super-blocks of 256 weights, 144 / 176 / 210 bytes; Q5_0 / Q5_1 blocks of 32, 22 / 24 bytes; F16 and
BF16 2 bytes a weight, F32 4). So the memory the weights take is the file's tensor bytes. Every value a kernel
multiplies by is gguf's own ``dequantize`` of those bytes (float32; bfloat16 activations: those values rounded to
bfloat16, as the GEMM path rounds them). Q4_0 / Q4_1 / Q8_0 have their own path (quant_blocks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# The GGUF types kept as rows, and each one's (weights, bytes) per block (gguf.GGML_QUANT_SIZES).
ROW_TYPES = {
    name: gguf.GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "F16", "BF16", "F32")
}


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

    def dequantize(self) -> torch.Tensor:
        """Float32 [N, K]: gguf's own dequantization, bit for bit."""
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
        self.register_buffer("raw", rows.raw)

    @property
    def rows(self) -> GGUFRows:
        return GGUFRows(self.raw, self.qtype, self.in_features)


class GGUFRowsLinear(_RowsModule):
    """A drop-in for ``nn.Linear`` (x [T, K] -> [T, N], x's dtype) over a file's rows, float activations."""

    def __init__(self, rows: GGUFRows, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(rows, dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.rows.dequantize().to(x.dtype), self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, overwrite_residual: bool = False) -> torch.Tensor:
        """residual + self(x) (``overwrite_residual``: the caller no longer needs ``residual``)."""
        out: torch.Tensor = residual + self(x)
        return out


class GGUFRowsEmbedding(_RowsModule):
    """A drop-in for ``nn.Embedding`` over a file's rows: a lookup dequantizes only the rows it reads."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.select(ids).dequantize().view(*ids.shape, self.in_features).to(self.dtype)
