"""The int8-activation kernel for the GGUF row types with codes (csrc/gguf_rows_q8_linear.cpp: Q4_K, Q5_K, Q6_K, Q5_0,
Q5_1; AVX512-VNNI through block_q8_panels.h, AVX2 through gguf_rows_q8_avx2.h, a portable loop elsewhere): gguf-py's
dequantized weights against the int8-rounded activations in float64 within a pinned bound (each block's integer dot
is exact, the float32 steps are the only error), on random valid blocks and on the K-quant fixtures; a row's bits
alone, in any batch and on 1 or 2 threads; GGUFRowsLinear's paths and a fixture loaded with ``--quantization
q4_1``."""

from __future__ import annotations

import pytest
import torch

from benchmarks.block_linears import random_rows
from radixserve.model import paged_kernel
from radixserve.model.gguf_loader import GGUFFile
from radixserve.model.gguf_rows import INT8_ROW_TYPES, GGUFRows, GGUFRowsLinear, int8_rows_pay
from radixserve.model.invariance import make_split_invariant
from radixserve.model.loader import load_model
from radixserve.model.quant_blocks import INT8_KERNEL_MAX_ROWS, quantize_activations
from tests.model.test_gguf_rows_kernels import gguf_values, same_bits
from tests.support.archs import gguf_path

pytestmark = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the kernels cannot build")
ops = torch.ops.radixserve
FIXTURES = ("llama-k256-q4_k_m", "llama-k256-q5_k_m", "llama-k256-q6_k")
# |kernel - reference| / (|x_hat| . |w|) (x_hat: the int8 codes times their scales; w: gguf's values), max over the
# random cases below: Q4_K 9.0e-8, Q5_K 9.7e-8, Q6_K 4.8e-8, Q5_0 7.0e-8, Q5_1 9.0e-8 (one float32 rounding is
# 6e-8: d * s, the fused multiply-add per block, the min's s * sum). Pinned with ~3x room. The AVX2 kernel (8 float
# lanes a row, each an uncentred partial dot; Q5_0's -16 and Q6_K's -32 added 8 blocks at a time): Q4_K 4.2e-8, Q5_K
# 3.6e-8, Q6_K 8.9e-8, Q5_0 1.2e-7, Q5_1 4.9e-8.
BOUND = {"Q4_K": 3e-7, "Q5_K": 3e-7, "Q6_K": 2e-7, "Q5_0": 2e-7, "Q5_1": 3e-7}
# Panels: streamed (1-4), tiles of 6 (Q6_K: 4) and their remainders; AVX2: tiles of 1-8 rows, and 17 = 8 + 8 + 1.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 33]


def width(qtype: str) -> int:
    return 768 if qtype.endswith("_K") else 192


def kernel(x: torch.Tensor, rows: GGUFRows, **kwargs: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = ops.gguf_rows_linear_q8(x, rows.raw, rows.type_id, rows.in_features, **kwargs)
    return out


def reference(x: torch.Tensor, rows: GGUFRows) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (x's int8 codes times their scales) @ gguf's values.T, and |x_hat| @ |w|.T (the bound's scale)."""
    codes, scales = quantize_activations(x)
    x_hat = (codes.view(x.shape[0], -1, 32).double() * scales.double()[..., None]).view(x.shape)
    w = gguf_values(rows).double()
    return x_hat @ w.T, (x_hat.abs() @ w.abs().T).clamp(min=1e-30)


def relative_error(got: torch.Tensor, x: torch.Tensor, rows: GGUFRows) -> float:
    expected, scale = reference(x.float(), rows)
    return float(((got.double() - expected).abs() / scale).max())


@pytest.mark.parametrize("qtype", INT8_ROW_TYPES)
def test_kernel_is_the_int8_math_and_a_rows_bits_its_own(qtype: str) -> None:
    rows = random_rows(qtype, 53, width(qtype), seed=3)  # 53 channels: panels of 16 and a partial one
    for m in ROWS:
        x = torch.randn(m, rows.in_features, generator=torch.Generator().manual_seed(m)) * 2
        x[0, 32:64] = 0.0  # an all-zero activation block among others
        got = kernel(x, rows)
        assert relative_error(got, x, rows) <= BOUND[qtype], m
        exact = x.double() @ gguf_values(rows).double().T  # float activations: the test tells the two apart
        assert ((exact - reference(x, rows)[0]).abs() / reference(x, rows)[1]).max() > 2e-5
        for r in range(m):
            assert same_bits(kernel(x[r : r + 1], rows), got[r : r + 1]), (m, r)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_an_odd_block_count_ends_on_a_line_of_one_block(qtype: str) -> None:
    """A Q5_0 / Q5_1 line holds two blocks' codes and scales: a row of 5 blocks ends on a line of one, its other
    half zeros, alone (1-4 rows read the scales from the lines) and in a batch (more rows: from the panels)."""
    rows = random_rows(qtype, 21, 160, seed=9)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(9))
    got = kernel(x, rows)
    assert relative_error(got, x, rows) <= BOUND[qtype]
    for r in range(7):
        assert same_bits(kernel(x[r : r + 1], rows), got[r : r + 1]), r


@pytest.mark.parametrize("qtype", INT8_ROW_TYPES)
def test_a_rows_bits_do_not_depend_on_the_threads(qtype: str) -> None:
    rows = random_rows(qtype, 100, width(qtype), seed=4)
    x = torch.randn(9, rows.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, rows)
        torch.set_num_threads(2)
        assert same_bits(kernel(x, rows), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", FIXTURES)
def test_the_k_quant_fixtures_matrices(name: str) -> None:
    """Every matrix of a real llama-quantize file whose type has codes, against gguf-py within the bound."""
    seen = set()
    for hf_name, data in GGUFFile(gguf_path(name)).blocks().items():
        if not isinstance(data, GGUFRows) or data.qtype not in INT8_ROW_TYPES:
            continue
        x = torch.randn(5, data.in_features, generator=torch.Generator().manual_seed(len(seen)))
        assert relative_error(kernel(x, data), x, data) <= BOUND[data.qtype], hf_name
        seen.add(data.qtype)
    assert seen & {"Q4_K", "Q5_K", "Q6_K"}


def test_bias_and_residual_as_the_q8_blocks_path() -> None:
    """bias added in float32 before the rounding to x's dtype; a residual after it, then rounded again."""
    rows = random_rows("Q4_K", 40, 512, seed=7)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(3, 512, generator=generator).bfloat16()
    bias, residual = torch.randn(40, generator=generator).bfloat16(), torch.randn(3, 40, generator=generator).bfloat16()
    plain = kernel(x.float(), rows)
    with_bias = kernel(x, rows, bias=bias)
    assert torch.equal(with_bias, (plain + bias.float()).bfloat16())
    added = kernel(x, rows, residual=residual)
    assert torch.equal(added, (plain.bfloat16().float() + residual.float()).bfloat16())


def test_float_types_are_refused_by_the_int8_kernel() -> None:
    rows = random_rows("F16", 16, 64, seed=1)
    with pytest.raises(RuntimeError, match="has no codes"):
        kernel(torch.randn(1, 64), rows)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_0"])
def test_module_paths_run_the_same_int8_math(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUFRowsLinear with int8 activations: the kernel, the tiled GEMM on the int8 rows' values past
    INT8_KERNEL_MAX_ROWS, the split-invariant kernel at every count, and torch ops without a kernel agree."""
    rows = random_rows(qtype, 48, width(qtype), seed=8)
    linear = GGUFRowsLinear(rows, None, torch.float32, int8_activations=True)
    assert (
        linear.int8_activations
        and not GGUFRowsLinear(random_rows("F16", 8, 64, 1), None, torch.float32, True).int8_activations
    )
    x = torch.randn(INT8_KERNEL_MAX_ROWS + 3, rows.in_features, generator=torch.Generator().manual_seed(8))
    expected, scale = reference(x, rows)
    tiled = linear(x)
    assert float(((tiled.double() - expected).abs() / scale).max()) <= 1e-6
    linear.invariant_kernel = "vector"
    assert torch.equal(linear(x), kernel(x, rows))
    monkeypatch.setattr(paged_kernel, "load", lambda: False)
    assert float(((linear(x).double() - expected).abs() / scale).max()) <= 1e-6


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="a CPU without AVX2")
def test_an_avx2_cpu_runs_the_int8_rows_on_simd() -> None:
    """AVX2 (with or without AVX512) has a SIMD int8 rows kernel: a model asked for int8 activations runs them on
    every row type with codes."""
    assert ops.gguf_rows_q8_simd() and int8_rows_pay()


def test_a_k_quant_file_with_int8_activations_runs_the_kernel_and_says_so() -> None:
    """Where the int8 rows kernel has a SIMD path (AVX512-VNNI panels, AVX2) the K-quant rows run int8 activations;
    elsewhere (no AVX2: a portable loop, 6x the float kernel's time) they keep float ones, and the detail says why."""
    loaded = load_model(str(gguf_path("llama-k256-q4_k_m")), torch.device("cpu"), torch.float32, quantization="q4_1")
    model = loaded.model
    pays = int8_rows_pay()
    assert pays == bool(torch.ops.radixserve.gguf_rows_q8_simd())
    rows = [m for m in model.modules() if isinstance(m, GGUFRowsLinear) and m.qtype in INT8_ROW_TYPES]
    assert rows and all(m.int8_activations == pays for m in rows)
    by_type = model.weights_by_type  # type: ignore[union-attr]
    assert {"Q4_K", "Q6_K"} <= set(by_type)
    assert all(r.activations == ("int8" if pays else "float") for r in by_type.values())
    detail = model.quantization_detail
    assert ("(int8 activations)" in detail) == pays, detail  # type: ignore[operator]
    assert ("int8 rows kernel is a portable loop" in detail) != pays, detail  # type: ignore[operator]
    holds, why = make_split_invariant(model)
    assert holds, why
