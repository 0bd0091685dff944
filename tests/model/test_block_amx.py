"""The AMX block linear (csrc/block_amx.cpp): bfloat16 rows against Q4_1 / Q4_0 / Q8_0 blocks, a row's bits the
same whatever the number of rows in the call. Skipped where the CPU (or the build) has no AMX-BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import paged_kernel
from radixserve.model.quant_blocks import QuantBlocks
from tests.model.test_quant_blocks import random_blocks
from tests.model.test_quant_blocks_q4_0 import random_q4_0

pytestmark = pytest.mark.skipif(
    not paged_kernel.load() or not torch.ops.radixserve.amx_available(),
    reason="no AMX-BF16 here (CPU, kernel or build): the op refuses to run",
)
# SmolLM2's K (576 = 18 blocks: a last partial group of 16; 1536), channel counts that leave a partial tile.
SHAPES = [(96, 576), (40, 1536), (37, 160)]


def amx(
    x: torch.Tensor, w: QuantBlocks, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.radixserve.block_linear_amx(x, w.qs, w.d, w.m, bias, residual)
    return out


def blocks_of(fmt: str, out_features: int, in_features: int, seed: int) -> QuantBlocks:
    if fmt == "q4_0":
        return QuantBlocks.from_gguf(random_q4_0(out_features, in_features, seed), "q4_0")
    return random_blocks(fmt, out_features, in_features, seed)


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_weights_are_the_gemm_paths_bfloat16_weights(fmt: str, out_features: int, in_features: int) -> None:
    """x = I picks out each weight: exactly the dequantized float32 weight rounded to bfloat16 (the tiled GEMM
    path's weights), every channel and block; and bias and residual are added to the float32 sum in that order
    before the one rounding."""
    w = blocks_of(fmt, out_features, in_features, seed=in_features)
    weight = w.dequantize().bfloat16()
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    assert torch.equal(amx(eye, w), weight.t())
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=generator).bfloat16()
    residual = torch.randn(in_features, out_features, generator=generator).bfloat16()
    expected = (weight.t().float() + bias.float() + residual.float()).bfloat16()
    assert torch.equal(amx(eye, w, bias, residual), expected)


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES[:2])
def test_a_rows_bits_do_not_depend_on_the_row_count(fmt: str, out_features: int, in_features: int) -> None:
    """The rows of one 600-row call equal the same rows computed in calls of 1 .. 599 rows starting anywhere
    (partial row tiles, one or two tiles, many), with bias and residual."""
    w = blocks_of(fmt, out_features, in_features, seed=out_features)
    generator = torch.Generator().manual_seed(out_features)
    x = (torch.randn(600, in_features, generator=generator) * 3).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    residual = torch.randn(600, out_features, generator=generator).bfloat16()
    whole = amx(x, w, bias, residual)
    for rows in (1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 64, 100, 383, 599):
        for start in {0, 600 - rows, int(torch.randint(0, 601 - rows, (1,), generator=generator))}:
            part = slice(start, start + rows)
            assert torch.equal(amx(x[part], w, bias, residual[part]), whole[part]), (rows, start)


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
def test_close_to_the_float_matmul_on_the_bfloat16_weights(fmt: str) -> None:
    """Against F.linear in float64 on the same bfloat16 x and weights: the rounding to bfloat16 (under 2^-8 of the
    value) plus the float32 sum's error (pinned at K * 2^-24 of sum |x| |w|; measured: 0 for Q4_1 and Q8_0, 3e-9
    for Q4_0, as torch's bfloat16 GEMM)."""
    w = blocks_of(fmt, 200, 1536, seed=3)
    x = (torch.randn(70, 1536, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    exact = F.linear(x.double(), w.dequantize().bfloat16().double())
    magnitude = F.linear(x.double().abs(), w.dequantize().bfloat16().double().abs())
    bound = exact.abs() * 2.0**-8 + magnitude * 1536 * 2.0**-24
    assert ((amx(x, w).double() - exact).abs() <= bound).all()
    # and not by luck: weights 1% off break it
    assert not (
        (amx(x, w).double() - F.linear(x.double(), w.dequantize().bfloat16().double() * 1.01)).abs() <= bound
    ).all()


def test_bad_inputs_are_refused_clearly() -> None:
    w = random_blocks("q4_1", 32, 64, seed=0)
    x = torch.randn(3, 64).bfloat16()
    ops = torch.ops.radixserve
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.block_linear_amx(x.float(), w.qs, w.d, w.m)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        ops.block_linear_amx(torch.randn(3, 96).bfloat16(), w.qs, w.d, w.m)
    with pytest.raises(RuntimeError, match="bias"):
        ops.block_linear_amx(x, w.qs, w.d, w.m, torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="residual"):
        ops.block_linear_amx(x, w.qs, w.d, w.m, None, torch.zeros(3, 32))
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32"):
        ops.block_linear_amx(x[:, :48], w.qs[:, :24].contiguous(), w.d, w.m)
    assert ops.block_linear_amx(x[:0], w.qs, w.d, w.m).shape == (0, 32)


def test_threads_split_channels_not_rows_bits() -> None:
    """Each thread configures its own tiles; the channel groups a thread takes change no bit."""
    w = random_blocks("q4_1", 200, 576, seed=5)
    x = torch.randn(50, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = amx(x, w)
        torch.set_num_threads(2)
        assert torch.equal(amx(x, w), alone)
    finally:
        torch.set_num_threads(threads)
