"""Symmetric 8-bit codes with an absmax scale: the 8-bit KV pools' rows and the host tier's compressed pages.

    int8:      codes = round(x / scale) in [-127, 127],   scale = max|x| / 127 over the reduced dims
    fp8_e4m3:  codes = fp8(x / scale) in [-448, 448],     scale = max|x| / 448 (round to nearest even)

and x ~ codes * scale. int8 spaces its 255 levels evenly (an error of at most scale / 2 anywhere in the row);
fp8_e4m3 keeps 3 mantissa bits at every magnitude (an error of at most 1/16 of the value, down to 2^-6 / 448 of
the row's max; evenly spaced below), so a row's small values keep more of their bits and its large ones fewer.

The scale is rounded to its storage dtype first and the codes are made with the rounded scale, so
storing the scale in bfloat16 costs nothing beyond the codes' own rounding (plus a possible clamp of
a half step at the row's max, where rounding the scale went down).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# The largest code of each 8-bit code dtype: what a row's max|x| maps to.
CODE_MAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max)}
# The scale of an all-zero row: any positive number (its codes are 0); a bfloat16 normal.
MIN_SCALE = 1e-30


def quantize_absmax(
    x: torch.Tensor,
    dim: int | tuple[int, ...],
    scale_dtype: torch.dtype = torch.float32,
    code_dtype: torch.dtype = torch.int8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in ``code_dtype`` (CODE_MAX's) shaped like ``x``, scale in ``scale_dtype`` with ``dim`` kept as
    size 1)."""
    top = CODE_MAX[code_dtype]
    values = x.float()
    scale = (values.abs().amax(dim=dim, keepdim=True) / top).clamp_min(MIN_SCALE).to(scale_dtype)
    scaled = values / scale.float()
    if code_dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp_(-top, top).to(code_dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale in ``dtype`` (scale broadcasts: size 1 on the quantized dims)."""
    return (codes.float() * scale.float()).to(dtype)
