"""The GGUF row kernels (csrc/gguf_rows_linear.cpp) against gguf-py: dequantization bit for bit, the decode kernel
within pinned float32 / bfloat16 bounds and independent of its batch, the tiled GEMM bit for bit F.linear, and
GGUFRowsLinear's paths across the kernel/tiled crossover."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.block_linears import random_rows
from radixserve.model import paged_kernel
from radixserve.model.gguf_rows import ROW_TYPES, GGUFRows, GGUFRowsEmbedding, GGUFRowsLinear, kernel_max_rows
from radixserve.model.layers import linear_add
from radixserve.model.precision import CpuFeatures

pytestmark = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the kernels cannot build")
ops = torch.ops.radixserve
TYPES = list(ROW_TYPES)
# |kernel - exact| / sum_k |x_k w_k|, float32 x: measured max over 6 seeds x 16 rows x K up to 3,072 (one float32
# rounding is 6e-8): Q4_K 5.4e-8, Q5_K 6.2e-8, Q6_K 6.1e-8, Q5_0 7.2e-8, Q5_1 5.7e-8, F16 4.6e-8, BF16 5.1e-8,
# F32 4.8e-8. Pinned with ~3x room; the order of the float32 sums is the kernel's only error. The bfloat16 tests add
# the output's rounding (2^-8 of it) to the same bound: measured excess over that 1e-9.
FLOAT32_BOUND = {
    "Q4_K": 2e-7,
    "Q5_K": 2e-7,
    "Q6_K": 2e-7,
    "Q5_0": 2e-7,
    "Q5_1": 2e-7,
    "F16": 2e-7,
    "BF16": 2e-7,
    "F32": 2e-7,
}

# bfloat16 x against the quantized types: the exact weights, as x . (128 + c) (exact products) times the scale plus
# (b - 128 a) * sum(x): the float32 sums of the larger 128 + c add error past the output's rounding. Measured max of
# that excess / sum_k |x_k w_k| over 6 seeds x 16 rows x 3 widths: Q4_K 2.9e-7, Q5_K 9.2e-8, Q6_K 1.3e-7, Q5_0 2.2e-7,
# Q5_1 3.3e-8. Pinned with ~3x room. (Weights rounded to bfloat16 would be off by 3e-4 to 1.3e-3.)
CODES_BOUND = {"Q4_K": 1e-6, "Q5_K": 3e-7, "Q6_K": 4e-7, "Q5_0": 7e-7, "Q5_1": 1e-7}


def width(qtype: str) -> int:
    return 768 if qtype.endswith("_K") else 96


def gguf_values(rows: GGUFRows) -> torch.Tensor:
    """gguf-py's own dequantization (numpy), the reference."""
    raw = rows.raw.numpy()
    if rows.qtype in ("F16", "F32"):
        values = raw.view(np.float16 if rows.qtype == "F16" else np.float32).astype(np.float32)
    else:
        values = gguf.quants.dequantize(raw, ROW_TYPES[rows.qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def kernel(x: torch.Tensor, rows: GGUFRows, **kwargs: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = ops.gguf_rows_linear(x, rows.raw, rows.type_id, rows.in_features, **kwargs)
    return out


def tiled(x: torch.Tensor, rows: GGUFRows, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    out: torch.Tensor = ops.gguf_rows_linear_tiled(x, rows.raw, rows.type_id, rows.in_features, bias, tile)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.view(torch.int32 if a.element_size() == 4 else torch.int16),
        b.view(torch.int32 if b.element_size() == 4 else torch.int16),
    )


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_gguf_bit_for_bit(qtype: str) -> None:
    rows = random_rows(qtype, 37, width(qtype), seed=1)
    assert same_bits(rows.dequantize(), gguf_values(rows))
    assert same_bits(ops.gguf_rows_dequantize(rows.raw[5:9], rows.type_id, rows.in_features), gguf_values(rows)[5:9])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_dequantize_is_gguf_bit_for_bit_for_any_finite_scales(qtype: str) -> None:
    """Scale fields of random bytes too (float16 subnormals up to 65504, either sign): only a non-finite one is
    replaced. Every product is exact in float32, so there is no rounding a fused multiply-add could change."""
    rows = random_rows(qtype, 64, width(qtype), seed=2)
    raw = rows.raw.clone()
    bits = raw.view(-1, gguf.GGML_QUANT_SIZES[ROW_TYPES[qtype]][1])
    generator = torch.Generator().manual_seed(3)
    bits.copy_(torch.randint(0, 256, bits.shape, dtype=torch.uint8, generator=generator))
    for at in {"Q6_K": (208,)}.get(qtype, (0, 2)):
        half = bits[:, at : at + 2].contiguous().view(torch.float16)
        half[~torch.isfinite(half)] = 1.0
        bits[:, at : at + 2] = half.view(torch.uint8)
    rows = GGUFRows(raw, qtype, rows.in_features)
    assert same_bits(rows.dequantize(), gguf_values(rows))


@pytest.mark.parametrize("qtype", TYPES)
def test_float32_linear_is_the_exact_weights_within_the_pinned_bound(qtype: str) -> None:
    for seed, k in enumerate((width(qtype), 1536)):
        rows = random_rows(qtype, 40, k, seed=seed)
        w = gguf_values(rows).double()
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(seed)) * 2
        exact = x.double() @ w.T
        error = (kernel(x, rows).double() - exact).abs() / (x.double().abs() @ w.abs().T)
        assert error.max().item() < FLOAT32_BOUND[qtype]


def bfloat16_weights(rows: GGUFRows) -> torch.Tensor:
    """What the bfloat16 decode kernel multiplies x by (float64): the quantized types' exact values where the
    kernel multiplies codes (AVX512-BF16), else (F16, F32; any type without it) the values rounded to bfloat16."""
    exact = rows.qtype in CODES_BOUND and CpuFeatures.detect().avx512_bf16
    values = gguf_values(rows)
    return values.double() if exact else values.bfloat16().double()


def bfloat16_bound(qtype: str) -> float:
    return CODES_BOUND[qtype] if qtype in CODES_BOUND and CpuFeatures.detect().avx512_bf16 else FLOAT32_BOUND[qtype]


@pytest.mark.parametrize("qtype", TYPES)
def test_bfloat16_linear_multiplies_the_weights_it_says(qtype: str) -> None:
    """Against the exact products of bfloat16 x and bfloat16_weights: the output's one rounding to bfloat16 (half an
    ulp: 2^-8 of it at most) and the float32 sums."""
    rows = random_rows(qtype, 40, width(qtype), seed=4)
    w = bfloat16_weights(rows)
    x = torch.randn(16, rows.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    exact = x.double() @ w.T
    out = kernel(x, rows)
    assert out.dtype == torch.bfloat16
    bound = 2**-8 * exact.abs() + bfloat16_bound(qtype) * (x.double().abs() @ w.abs().T)
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_bits_do_not_depend_on_its_batch_or_threads(qtype: str, dtype: torch.dtype) -> None:
    rows = random_rows(qtype, 53, width(qtype), seed=5)  # 53 channels: tiles of 8, 4, 2 and single ones
    n = kernel_max_rows(dtype)  # every batch the module runs the kernel on (bfloat16 past 8 rows: decoded chunks)
    x = torch.randn(n, rows.in_features, generator=torch.Generator().manual_seed(5)).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], rows) for i in range(n)])
    for batch in range(2, n + 1):
        assert same_bits(kernel(x[n - batch :], rows), alone[n - batch :])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert same_bits(kernel(x, rows), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_are_bit_for_bit_f_linear(qtype: str, dtype: torch.dtype) -> None:
    rows = random_rows(qtype, 131, width(qtype), seed=6)
    weight = gguf_values(rows).to(dtype)
    generator = torch.Generator().manual_seed(6)
    bias = torch.randn(131, generator=generator).to(dtype)
    x = torch.randn(40, rows.in_features, generator=generator).to(dtype)
    # Several tiles, a last partial one, one tile past N. At least 48 columns, as tile_columns' 64: torch's bfloat16
    # addmm into 32 columns or fewer sums another way for K >= 768 (measured, the whole weight alone).
    for tile in (48, 64, 4096):
        assert same_bits(tiled(x, rows, None, tile), F.linear(x, weight))
        assert same_bits(tiled(x, rows, bias, tile), F.linear(x, weight, bias))
    residual = torch.randn(40, 131, generator=generator).to(dtype)
    expected = tiled(x, rows, residual, 48)
    added = ops.gguf_rows_linear_tiled_add_(residual, x, rows.raw, rows.type_id, rows.in_features, 48)
    assert added is residual and same_bits(residual, expected)


def test_tiled_bfloat16_rounds_f32_subnormals_as_torch() -> None:
    values = torch.tensor([1e-40, -3e-39, 2**-130, 1.0 + 2**-8, 1.0 + 3 * 2**-8, float("inf")]).repeat(8, 16)
    rows = GGUFRows(values.view(torch.uint8).clone(), "F32", 96)
    x = torch.ones(20, 96, dtype=torch.bfloat16)
    assert same_bits(tiled(x, rows, None, 16), F.linear(x, values.bfloat16()))


def test_bias_and_residual_are_added_before_the_one_rounding() -> None:
    """float32: bitwise the sums plus the bias plus the residual; bfloat16: one rounding of the three (a rounding
    of the sums first would leave errors up to 2^-8 of the sums alone, here 1,000 times the output's)."""
    rows = random_rows("Q5_K", 24, 512, seed=7)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(3, 512, generator=generator)
    bias, residual = torch.randn(24, generator=generator), torch.randn(3, 24, generator=generator)
    sums = kernel(x, rows)
    assert same_bits(kernel(x, rows, bias=bias, residual=residual), sums + bias + residual)
    xb, bias, residual = x.bfloat16(), bias.bfloat16(), -sums.bfloat16() + 1e-3 * residual.bfloat16()
    w = bfloat16_weights(rows)
    exact = xb.double() @ w.T + bias.double() + residual.double()
    out = kernel(xb, rows, bias=bias, residual=residual).double()
    bound = 2**-8 * exact.abs() + bfloat16_bound("Q5_K") * (xb.double().abs() @ w.abs().T)
    assert ((out - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_paths_across_the_crossover(dtype: torch.dtype) -> None:
    rows = random_rows("Q6_K", 48, 256, seed=8)
    generator = torch.Generator().manual_seed(8)
    bias = torch.randn(48, generator=generator)
    weight = gguf_values(rows).to(dtype)
    for b in (None, bias):
        linear = GGUFRowsLinear(rows, b, dtype)
        for n in (1, kernel_max_rows(dtype), kernel_max_rows(dtype) + 1, 60):
            x = torch.randn(n, 256, generator=generator).to(dtype)
            residual = torch.randn(n, 48, generator=generator).to(dtype)
            kept = residual.clone()
            bias_x = None if b is None else b.to(dtype)
            if n <= kernel_max_rows(dtype):
                assert same_bits(linear(x), kernel(x, rows, bias=bias_x))
                assert same_bits(linear.forward_add(x, residual), kernel(x, rows, bias=bias_x, residual=residual))
            else:
                assert same_bits(linear(x), F.linear(x, weight, bias_x))
                fused = residual + F.linear(x, weight, bias_x) if b is not None else torch.addmm(residual, x, weight.T)
                assert same_bits(linear.forward_add(x, residual), fused)
                assert same_bits(linear_add(linear, x, residual, overwrite_residual=True), fused)
                residual = kept.clone()
            assert same_bits(residual, kept)  # never written without overwrite_residual


def test_module_without_the_kernel_is_gguf_dequantize_and_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = random_rows("Q5_1", 20, 64, seed=9)
    linear = GGUFRowsLinear(rows, None, torch.float32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    monkeypatch.setattr(paged_kernel, "load", lambda: False)
    assert same_bits(linear(x), F.linear(x, gguf_values(rows)))
    assert same_bits(linear.forward_add(x, x[:, :20]), x[:, :20] + F.linear(x, gguf_values(rows)))


def test_embedding_dequantizes_the_looked_up_rows() -> None:
    rows = random_rows("Q4_K", 30, 256, seed=10)
    embedding = GGUFRowsEmbedding(rows, torch.bfloat16)
    ids = torch.tensor([[3, 29], [0, 3]])
    assert same_bits(embedding(ids), gguf_values(rows)[ids].bfloat16())


def test_clear_errors_for_a_wrong_type_or_row_bytes() -> None:
    rows = random_rows("Q4_K", 4, 256, seed=11)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="not a GGUF row type"):
        ops.gguf_rows_linear(x, rows.raw, int(gguf.GGMLQuantizationType.Q4_0), 256)
    with pytest.raises(RuntimeError, match=r"raw: uint8 \[N, 176\]"):
        ops.gguf_rows_linear(x, rows.raw, int(gguf.GGMLQuantizationType.Q5_K), 256)
    with pytest.raises(RuntimeError, match="whole units of 256"):
        ops.gguf_rows_dequantize(rows.raw, rows.type_id, 200)
