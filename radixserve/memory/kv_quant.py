"""Symmetric int8 with an absmax scale: the 8-bit KV pool's rows and the host tier's compressed pages.

    codes = round(x / scale) in [-127, 127],   scale = max|x| / 127 over the reduced dims,   x ~ codes * scale

The scale is rounded to its storage dtype first and the codes are made with the rounded scale, so
storing the scale in bfloat16 costs nothing beyond the codes' own rounding (at most scale / 2 per element,
plus a possible clamp of 0.5 / 127 of the max where rounding the scale went down).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# The scale of an all-zero row: any positive number (its codes are 0); a bfloat16 normal.
MIN_SCALE = 1e-30


def quantize_absmax(
    x: torch.Tensor, dim: int | tuple[int, ...], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 shaped like ``x``, scale in ``scale_dtype`` with ``dim`` kept as size 1)."""
    values = x.float()
    scale = (values.abs().amax(dim=dim, keepdim=True) / INT8_MAX).clamp_min(MIN_SCALE).to(scale_dtype)
    codes = torch.round(values / scale.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale in ``dtype`` (scale broadcasts: size 1 on the quantized dims)."""
    return (codes.float() * scale.float()).to(dtype)
