"""Block linears over many rows (csrc/block_gemm.cpp): a cache-sized tile of dequantized weights at a time
through the dtype's GEMM, bit for bit F.linear on the whole float weight, and never the whole weight per call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import quant_blocks
from radixserve.model.quant_blocks import INT8_KERNEL_MAX_ROWS, KERNEL_MAX_ROWS, BlockLinear, QuantBlocks, tile_columns
from tests.model.test_quant_blocks import gguf_model, needs_kernel, random_blocks
from tests.model.test_quant_blocks_int8 import integer_reference
from tests.model.tiny import alloc, make_batch, make_pool

pytestmark = needs_kernel
SHAPES = [(37, 160), (5, 1536), (131, 96), (1000, 64)]  # odd channel counts, tiles that do not divide N


def tiled(x: torch.Tensor, blocks: QuantBlocks, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    out: torch.Tensor = torch.ops.radixserve.block_linear_tiled(x, blocks.qs, blocks.d, blocks.m, bias, tile)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("tile", [16, 48, 4096])  # several tiles, a last partial one, one tile past N
def test_tiles_are_bit_for_bit_the_whole_weights_gemm(
    fmt: str, out_features: int, in_features: int, tile: int, dtype: torch.dtype
) -> None:
    """bfloat16: the tiles are dequantized straight to bfloat16, the whole weight rounded from float32."""
    blocks = random_blocks(fmt, out_features, in_features, seed=out_features)
    weight = blocks.dequantize().to(dtype)
    generator = torch.Generator().manual_seed(tile)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    for rows in (1, 17, 80, 300):
        x = (torch.randn(rows, in_features, generator=generator) * 3).to(dtype)
        assert torch.equal(tiled(x, blocks, None, tile), F.linear(x, weight))
        assert torch.equal(tiled(x, blocks, bias, tile), F.linear(x, weight, bias))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_bfloat16_tiles_round_extreme_scales_as_the_whole_weight(fmt: str) -> None:
    """Scales and mins from float16's subnormals to its largest, either sign (each weight rounded to bfloat16 as
    .to(torch.bfloat16) rounds it, ties included); a tile with an infinite or NaN scale gives NaN and inf in the
    same places as the whole weight's GEMM (that tile takes the float32 path)."""
    codes = random_blocks(fmt, 96, 128, seed=3)
    generator = torch.Generator().manual_seed(12)
    extremes = torch.tensor([2**-24, -(2**-24), 3 * 2**-24, 2**-14, 1 / 3, -7.5, 1000.0, 65504.0, -65504.0, 0.0])
    picks = torch.randint(0, len(extremes), codes.d.shape, generator=generator)
    m = None if codes.m is None else extremes[picks.roll(1, 0)].to(torch.float16)
    blocks = QuantBlocks(codes.qs, extremes[picks].to(torch.float16), m)
    x = torch.randn(40, 128, generator=generator).to(torch.bfloat16)
    weight = blocks.dequantize().to(torch.bfloat16)
    assert torch.equal(tiled(x, blocks, None, 32), F.linear(x, weight))
    blocks.d[40, 1], blocks.d[70, 2] = float("inf"), float("nan")  # in the second and third tiles of 32
    weight = blocks.dequantize().to(torch.bfloat16)
    torch.testing.assert_close(tiled(x, blocks, None, 32), F.linear(x, weight), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_layer_equals_the_reference_for_every_row_count(fmt: str, int8_activations: bool) -> None:
    """Rows 1..300 through BlockLinear (the kernel up to its limit, tiles past it) against float64 references:
    the dequantized float weight @ x, or with int8 activations the integer math of their codes."""
    blocks = random_blocks(fmt, 131, 192, seed=4)
    bias = torch.randn(131, generator=torch.Generator().manual_seed(5))
    layer = BlockLinear(blocks, bias, torch.float32, int8_activations)
    x = torch.randn(300, 192, generator=torch.Generator().manual_seed(6)) * 2
    weight = blocks.dequantize().double()
    scale = x.abs().sum(-1, keepdim=True).double() * weight.abs().max()
    for rows in (*range(1, 40), 63, 64, 65, 127, 128, 129, 255, 300):
        got = layer(x[:rows]).double()
        if int8_activations:
            expected = integer_reference(x[:rows], blocks) + bias.double()
        else:
            expected = F.linear(x[:rows].double(), weight, bias.double())
        assert ((got - expected).abs() / scale[:rows]).max().item() <= 1e-6, rows


def test_the_residual_is_added_inside_the_gemm_as_the_float_model_adds_it() -> None:
    """The float model adds a residual inside the GEMM (addmm); at K >= 576 that differs from residual + mm in
    the last bit, so the blocks add it there too: SmolLM2's o_proj (K 576) and down_proj (K 1536) shapes."""
    from radixserve.model.layers import linear_add

    for in_features in (576, 1536):
        blocks = random_blocks("q4_1", 576, in_features, seed=in_features)
        x, residual = torch.randn(KERNEL_MAX_ROWS + 40, in_features), torch.randn(KERNEL_MAX_ROWS + 40, 576)
        expected = torch.addmm(residual, x, blocks.dequantize().t())
        assert torch.equal(linear_add(BlockLinear(blocks, None, torch.float32), x, residual), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adding_into_the_residual_in_place_keeps_the_bits(dtype: torch.dtype) -> None:
    """overwrite_residual: the tiles' GEMMs add into the residual itself (no copy of it first), with the bits of
    the GEMM that adds a copy (K 576 and 1536, where residual + mm differs); without it the residual is untouched."""
    from radixserve.model.layers import linear_add

    for in_features, tile in ((576, 4096), (1536, 160), (1536, 48)):
        blocks = random_blocks("q4_1", 576, in_features, seed=in_features + tile)
        layer = BlockLinear(blocks, None, dtype)
        generator = torch.Generator().manual_seed(tile)
        x = torch.randn(KERNEL_MAX_ROWS + 40, in_features, generator=generator).to(dtype)
        residual = (torch.randn(KERNEL_MAX_ROWS + 40, 576, generator=generator) * 4).to(dtype)
        expected = tiled(x, blocks, residual, tile)
        kept = residual.clone()
        by_copy = linear_add(layer, x, residual)
        assert torch.equal(by_copy, torch.addmm(residual, x, blocks.dequantize().to(dtype).t()))
        assert torch.equal(residual, kept)
        got = torch.ops.radixserve.block_linear_tiled_add_(residual, x, blocks.qs, blocks.d, blocks.m, tile)
        assert got.data_ptr() == residual.data_ptr() and torch.equal(got, expected)
        residual = kept.clone()
        # the layer's own tile width: with AMX, oneDNN's bf16 GEMM gives other bits at another width
        got = linear_add(layer, x, residual, overwrite_residual=True)
        assert got.data_ptr() == residual.data_ptr() and torch.equal(got, by_copy)
    with pytest.raises(RuntimeError, match="residual: contiguous"):
        torch.ops.radixserve.block_linear_tiled_add_(residual.t(), x, blocks.qs, blocks.d, blocks.m, 48)


def test_int8_rows_up_to_the_kernels_limit_have_the_same_bits_alone_or_batched() -> None:
    """With int8 activations the kernel runs up to 48 rows (faster than the tiles there): every row of such a
    batch has the bits it has alone."""
    layer = BlockLinear(random_blocks("q4_1", 70, 128, seed=10), None, torch.float32, int8_activations=True)
    x = torch.randn(INT8_KERNEL_MAX_ROWS, 128)
    together = layer(x)
    assert all(torch.equal(layer(x[r : r + 1]), together[r : r + 1]) for r in range(x.shape[0]))


def test_many_rows_never_dequantize_the_whole_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the kernel's rows only a tile of the weight is ever float: no whole-weight dequantization."""
    blocks = random_blocks("q4_1", 300, 256, seed=7)
    layer = BlockLinear(blocks, None, torch.float32)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 256)
    expected = F.linear(x, blocks.dequantize())

    def whole(self: QuantBlocks) -> torch.Tensor:
        raise AssertionError("the whole weight was dequantized")

    monkeypatch.setattr(QuantBlocks, "dequantize", whole)
    monkeypatch.setattr(QuantBlocks, "dequantize_fast", whole)
    assert torch.equal(layer(x), expected)


def test_tile_columns_fit_the_tile_bytes_in_multiples_of_16() -> None:
    for in_features in (32, 576, 1536, 8192, 1 << 20):
        columns = tile_columns(in_features)
        assert columns % 16 == 0 and columns >= 64
        assert columns == 64 or columns * in_features * 4 <= quant_blocks.TILE_BYTES


def test_a_bfloat16_model_gets_bfloat16_out_of_the_tiles() -> None:
    blocks = random_blocks("q4_1", 40, 96, seed=8)
    x = torch.randn(KERNEL_MAX_ROWS + 20, 96).to(torch.bfloat16)
    got = BlockLinear(blocks, None, torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    expected = F.linear(x, blocks.dequantize().to(torch.bfloat16))  # the weight rounded to bfloat16 as before
    assert torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_a_clear_error() -> None:
    blocks = random_blocks("q4_1", 8, 64, seed=0)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        tiled(torch.randn(20, 32), blocks, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        tiled(torch.randn(20, 64), blocks, torch.zeros(7), 16)
    with pytest.raises(RuntimeError, match="tile_columns"):
        tiled(torch.randn(20, 64), blocks, None, 0)


def test_prefill_over_many_tiles_is_exactly_the_float_model(
    q4_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q4_1-exact's prefill logits (rows past the kernel, in tiles of 64 channels: the lm_head's 128 in two)
    equal float32's on the same GGUF bit for bit."""
    monkeypatch.setattr(quant_blocks, "TILE_BYTES", 1)  # the smallest tile: 64 channels
    ids = torch.randint(3, 128, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    logits = []
    for quantization in ("none", "q4_1-exact"):
        model = gguf_model(q4_gguf, quantization)
        pool, allocator = make_pool(model.config)
        context = alloc(allocator, 90)
        model(make_batch("extend", [(ids[:30], context[:30])]), pool)  # a cached prefix, then an extend on it
        logits.append(model(make_batch("extend", [(ids[30:], context)]), pool, return_all_logits=True))
    assert torch.equal(logits[0], logits[1])  # the lm_head's 60 rows too (Q8_0 blocks of the embedding)
