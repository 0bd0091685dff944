"""The GGUF row decode kernel's AVX2 path (CPUs with AVX2, FMA and F16C but not AVX512): linear_portable's
arithmetic, bit for bit. Each (row, channel) sums x_i * w_i in 8 lanes (lane i mod 8, in order of i, one fused
multiply-add each), then ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)); bfloat16 x multiplies the weights rounded
to bfloat16. Emulated here with numpy over every row and channel at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.block_linears import random_rows
from radixserve.model import paged_kernel
from radixserve.model.gguf_rows import ROW_TYPES
from radixserve.model.precision import cpu_flags
from tests.model.test_gguf_rows_kernels import gguf_values, kernel, same_bits, width


def avx2_path() -> bool:
    """Whether the kernel builds its AVX2 path here (gguf_rows.h: RADIXSERVE_ROWS_AVX2)."""
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    return {"avx2", "fma", "f16c"} <= flags and not avx512


pytestmark = [
    pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the kernels cannot build"),
    pytest.mark.skipif(not avx2_path(), reason="the AVX2 path runs on CPUs with AVX2 and without AVX512"),
]


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once: the product is exact in float64, and the float64 sum's own rounding lands on
    a float32 tie (the one case where rounding twice differs) about once in 2^29 sums."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def portable_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in linear_portable's order, float32."""
    xs = x.float().numpy().reshape(x.shape[0], 1, -1, 8)
    ws = w.float().numpy().reshape(1, w.shape[0], -1, 8)
    acc = np.zeros((x.shape[0], w.shape[0], 8), dtype=np.float32)
    for step in range(xs.shape[2]):
        acc = fma32(xs[:, :, step], ws[:, :, step], acc)
    a = [acc[..., lane] for lane in range(8)]
    return torch.from_numpy(((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])))


@pytest.mark.parametrize("k", [0, 1536])  # 0: the type's test width; 1,536: float rows tile 4 rows past 768
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", list(ROW_TYPES))
def test_avx2_kernel_is_linear_portable_bit_for_bit(qtype: str, dtype: torch.dtype, k: int) -> None:
    """Every batch's rows against the same emulation: a row's bits alone, in any batch, in any tile."""
    rows = random_rows(qtype, 29, k or width(qtype) * 2, seed=7)  # 29 channels: tiles of 8, 4, 2 and single ones
    w = gguf_values(rows)
    if dtype == torch.bfloat16:
        w = w.bfloat16().float()
    x = torch.randn(21, rows.in_features, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = portable_linear(x, w).to(dtype)
    for batch in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 16, 21):  # every tile shape, and balanced row tiles past the first
        assert same_bits(kernel(x[:batch], rows), expected[:batch])
