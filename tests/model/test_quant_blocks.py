"""q4_1: GGUF-style Q4_1 / Q8_0 blocks, their C++ linear, and the file's blocks kept as they are."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixserve import Engine
from radixserve.model import paged_kernel
from radixserve.model.gguf_loader import load_gguf, load_gguf_blocks
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.quant import BLOCK_QUANTIZATIONS, weight_bytes
from radixserve.model.quant_blocks import (
    FORMATS,
    KERNEL_MAX_ROWS,
    BlockEmbedding,
    BlockLinear,
    QuantBlocks,
    choose_bf16_rows_path,
)
from tests.model.tiny import alloc, load_ours, make_batch, make_pool

needs_kernel = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the block kernel cannot build")


def random_blocks(fmt: str, out_features: int, in_features: int, seed: int) -> QuantBlocks:
    generator = torch.Generator().manual_seed(seed)
    # Rows of very different ranges and an offset: Q4_1's min and scale both matter.
    weight = torch.randn(out_features, in_features, generator=generator) * torch.logspace(-2, 1, out_features)[:, None]
    return QuantBlocks.quantize(weight + 0.3, fmt)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_dequantize_is_gguf_own_bit_for_bit(fmt: str) -> None:
    weight = torch.randn(37, 160)
    raw = gguf.quants.quantize(weight.numpy(), FORMATS[fmt])
    blocks = QuantBlocks.from_gguf(raw, fmt)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, FORMATS[fmt]))
    assert torch.equal(blocks.dequantize(), expected)
    assert torch.equal(blocks.dequantize_fast(), expected)  # the C++ dequantization where it builds
    assert (expected - weight).abs().max() <= (weight.abs().max() / (7 if fmt == "q4_1" else 100))


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 9, 10, 11, 16, 40])  # 9, 10: one tile (AVX2); 11: 6 + 5; 40: dequantize + GEMM
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 160), (64, 32), (5, 1536)])
def test_block_linear_equals_the_dequantized_matmul(fmt: str, rows: int, out_features: int, in_features: int) -> None:
    blocks = random_blocks(fmt, out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(100 + rows)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 2
    layer = BlockLinear(blocks, bias, torch.float32)
    expected = F.linear(x.double(), blocks.dequantize().double(), bias.double())
    got = layer(x)
    scale = x.abs().sum(-1, keepdim=True).double() * blocks.dequantize().abs().max().double()
    assert ((got.double() - expected).abs() / scale).max().item() <= 1e-6
    if rows <= KERNEL_MAX_ROWS:  # the kernel: a row's bits never depend on the rest of its batch
        for r in (0, rows - 1):
            assert torch.equal(layer(x[r : r + 1]), got[r : r + 1])


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [9, 13, 16])
def test_bfloat16_rows_past_a_tile_are_each_row_alone(fmt: str, rows: int) -> None:
    """Past a tile of 8 rows the bfloat16 kernel decodes a chunk's weights once for all its row tiles; up to 8 it
    decodes them in each tile. The same bfloat16 weights and the same sums: each row's bits are the row's alone
    (Q8_0 with int8 weight-only's channel scales; 37 channels: two chunks and a partial one, 18 blocks: a group
    of 16 and a partial one)."""
    blocks = random_blocks(fmt, 37, 576, seed=rows)
    generator = torch.Generator().manual_seed(200 + rows)
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16()
    scales = (torch.rand(37, generator=generator) + 0.5).bfloat16() if fmt == "q8_0" else None

    def kernel(rows_of_x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.radixserve.block_linear(
            rows_of_x, blocks.qs, blocks.d, blocks.m, bias, None, scales, False
        )
        return out

    got = kernel(x)
    for r in range(rows):
        assert torch.equal(kernel(x[r : r + 1]), got[r : r + 1])
    # Against float64 of the float weights: bfloat16 weights (AVX512-BF16) or exact ones (elsewhere), both within.
    weight = blocks.dequantize().double() * (scales.double()[:, None] if scales is not None else 1.0)
    expected = x.double() @ weight.t() + bias.double()
    scale = x.abs().double().sum(-1, keepdim=True) * weight.abs().max() + bias.abs().max().double()
    assert ((got.double() - expected).abs() / scale).max().item() <= 1e-2


def awkward_bfloat16_rows(rows: int, in_features: int, seed: int) -> torch.Tensor:
    """bfloat16 rows that test a dot product's rounding: random magnitudes over 2^-20..2^20, zeros and -0, pairs
    (x[2i], x[2i + 1]) that cancel, values at the edges of the FMA kernel's range (2^-88, just under 2^88)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator) * 2.0 ** torch.randint(
        -20, 21, (rows, in_features), generator=generator
    )
    x[:, 1::2][: rows // 2] = -x[:, 0::2][: rows // 2]
    x[:, 3::17] = 0.0
    x[:, 5::19] = -0.0
    x[0, 7], x[-1, 9] = 2.0**-88, -(2.0**87) * 1.5
    return x.bfloat16()


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_bfloat16_rows_have_one_set_of_bits_at_every_row_count(fmt: str) -> None:
    """Two or more bfloat16 rows run float32 FMAs where one row runs vdpbf16ps (block_bf16_fma.h: the same bits
    wherever nothing is denormal), turned on here wherever they reproduce this CPU's instruction (by default
    choose_bf16_rows_path keeps them where they are also faster): every row of 1..40-row calls (one row, tiles
    of up to 10 and their remainders, past the FMA kernel's 32 rows) and at 1 and 2 threads equals that row
    alone, on rows that stress the rounding; a row with a value outside the FMA kernel's range sends its call
    to the instruction, same bits."""
    blocks = random_blocks("q4_1" if fmt == "q4_0" else fmt, 37, 576, seed=5)
    m = None if fmt != "q4_1" else blocks.m
    x = awkward_bfloat16_rows(40, 576, seed=6)

    def kernel(rows_of_x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.radixserve.block_linear(rows_of_x, blocks.qs, blocks.d, m, None, None, None)
        return out

    alone = torch.cat([kernel(x[r : r + 1]) for r in range(len(x))])
    threads = torch.get_num_threads()
    torch.ops.radixserve.block_linear_bf16_fma(True)
    try:
        for count in (2, 3, 4, 5, 8, 9, 10, 11, 17, 32, 40):
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(kernel(x[:count]).view(torch.int16), alone[:count].view(torch.int16)), (count, n)
        tiny = x[:9].clone()
        tiny[4, 0] = 2.0**-100  # below the range: the whole call runs vdpbf16ps
        assert torch.equal(kernel(tiny)[5:].view(torch.int16), alone[5:9].view(torch.int16))
    finally:
        torch.set_num_threads(threads)
        assert not torch.ops.radixserve.block_linear_bf16_fma(False)
        torch.ops.radixserve.block_linear_bf16_fma(choose_bf16_rows_path())  # as this process measured


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 15, 16])
@pytest.mark.parametrize("extras", ["none", "bias", "residual", "scales", "all", "rounded_then_residual"])
def test_the_kernel_rounds_its_output_as_torch_does(dtype: torch.dtype, rows: int, extras: str) -> None:
    """Integer weights (Q8_0, d = 1) and activations: every dot product is exact in float32 whatever the order of
    its sums, so the kernel's output must be torch's float32 epilogue bit for bit: (sum * scale + bias),
    [rounded to the dtype,] + residual, rounded to the dtype. Row counts of every tile shape, 37 channels (two
    chunks and a partial one); scales are powers of 2, exact in bfloat16 weights too."""
    generator = torch.Generator().manual_seed(rows)
    out_features, in_features = 37, 64
    codes = torch.randint(-8, 9, (out_features, in_features), generator=generator, dtype=torch.int8)
    d = torch.ones(out_features, in_features // 32, dtype=torch.float16)
    x = torch.randint(-4, 5, (rows, in_features), generator=generator).to(dtype)
    scales = (2.0 ** torch.randint(-3, 4, (out_features,), generator=generator)).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    residual = torch.randn(rows, out_features, generator=generator).to(dtype)
    with_scales = extras in ("scales", "all", "rounded_then_residual")
    with_bias = extras in ("bias", "all", "rounded_then_residual")
    with_residual = extras in ("residual", "all", "rounded_then_residual")
    got = torch.ops.radixserve.block_linear(
        x,
        codes,
        d,
        None,
        bias if with_bias else None,
        residual if with_residual else None,
        scales if with_scales else None,
        extras == "rounded_then_residual",
    )
    expected = (x.double() @ codes.double().t()).float()
    if with_scales:
        expected = expected * scales.float()
    if with_bias:
        expected = expected + bias.float()
    if extras == "rounded_then_residual":
        expected = expected.to(dtype).float()
    if with_residual:
        expected = expected + residual.float()
    assert got.dtype == dtype
    assert torch.equal(got, expected.to(dtype))


@needs_kernel
def test_a_bfloat16_model_gets_bfloat16_out_of_the_kernel() -> None:
    """Within bfloat16 rounding of float32: of the output, and with AVX512-BF16 of each weight (the kernel then
    multiplies by the weights rounded to bfloat16, as the GEMM path does): at most 2^-9 of sum |x| |w| each."""
    layer = BlockLinear(random_blocks("q4_1", 8, 64, seed=0), None, torch.bfloat16)
    weight = layer.blocks.dequantize()
    for seed in range(20):
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        got = layer(x)
        assert got.dtype == torch.bfloat16
        expected = F.linear(x.float(), weight)
        bound = 2**-9 * (x.float().abs() @ weight.abs().t()) + 2**-8 * expected.abs()
        assert ((got.float() - expected).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 5, 12])
def test_bfloat16_rows_multiply_the_exact_q4_weights(fmt: str, rows: int) -> None:
    """With bfloat16 x the kernel computes d * (x . (128 + q)) + (m - 128 d) * sum(x) in float32: the exact
    weights, so each output is the exact product rounded once to bfloat16, give or take float32's sums (weights
    rounded to bfloat16 first would be off by up to 2^-9 of sum |x| |w|, far past this bound). Without
    AVX512-BF16 the kernel multiplies float32 x by the exact weights: the same bound holds."""
    weight = torch.randn(37, 576, generator=torch.Generator().manual_seed(rows)) + 0.3
    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0 if fmt == "q4_0" else FORMATS[fmt])
    blocks = QuantBlocks.from_gguf(raw, fmt)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(300 + rows)).bfloat16()
    got = torch.ops.radixserve.block_linear(x, blocks.qs, blocks.d, blocks.m, None, None, None, False)
    weight = blocks.dequantize().double()
    exact = x.double() @ weight.t()
    float32_sums = 2**-18 * (
        x.double().abs() @ (weight.abs() + blocks.d.double().abs().repeat_interleave(32, 1) * 128).t()
    )
    assert ((got.double() - exact).abs() <= 2**-8 * exact.abs() + float32_sums).all()


def test_without_the_kernel_the_torch_path_gives_the_same_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = random_blocks("q4_1", 24, 96, seed=3)
    x = torch.randn(3, 96)
    layer = BlockLinear(blocks, None, torch.float32)
    expected = F.linear(x, blocks.dequantize())
    monkeypatch.setattr(paged_kernel, "load", lambda: False)  # no compiler (or CUDA): dequantize + matmul
    assert torch.allclose(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_shapes_the_blocks_cannot_hold_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantBlocks.quantize(torch.randn(4, 40), "q4_1")


Q4_1, Q8_0, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32


def test_the_files_blocks_dequantize_to_exactly_the_float_tensors(mixed_gguf: Path) -> None:
    _, tensors = load_gguf(mixed_gguf)
    kept = load_gguf_blocks(mixed_gguf)
    assert {blocks.fmt for blocks in kept.values()} == {"q4_1", "q8_0", "f32"}
    assert kept["model.embed_tokens.weight"].fmt == "q8_0"
    assert kept["model.layers.0.self_attn.q_proj.weight"].fmt == "q4_1"  # rows un-permuted as the floats are
    assert kept["model.layers.0.self_attn.k_proj.weight"].fmt == "f32"  # F32 in the file: kept as its rows
    for name, blocks in kept.items():
        assert torch.equal(blocks.dequantize(), tensors[name]), name


def gguf_model(path: Path, quantization: str) -> LlamaForCausalLM:
    config, tensors = load_gguf(path)
    model = LlamaForCausalLM(config)
    model.load_weights(tensors)
    model.quantize(quantization, load_gguf_blocks(path) if quantization in BLOCK_QUANTIZATIONS else None)
    return model


def test_kept_blocks_run_exactly_the_float_model_at_prefill_and_closely_at_decode(q4_gguf: Path) -> None:
    """Many rows dequantize the kept blocks and use the same GEMM as float32: the same bits. Decode
    rows go through the kernel (another summation order): within float32 rounding."""
    ids = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for quantization in ("none", "q4_1-exact"):  # q4_1 itself: int8 activations, test_quant_blocks_int8.py
        model = gguf_model(q4_gguf, quantization)
        pool, allocator = make_pool(model.config)
        context = alloc(allocator, 24)
        prefill = model(make_batch("extend", [(ids[:20], context[:20])]), pool, return_all_logits=True)
        decode = [model(make_batch("decode", [([ids[t]], context[: t + 1])]), pool) for t in range(20, 24)]
        logits[quantization] = (prefill, torch.cat(decode))
    q4 = logits["q4_1-exact"][0]
    assert isinstance(gguf_model(q4_gguf, "q4_1-exact").embed_tokens, BlockEmbedding)
    assert torch.equal(q4[:-1], logits["none"][0][:-1])  # the last row's lm_head alone: the kernel
    # Relative to the logits' scale (max |logit| ~23 here): float32 rounding after two layers summed in another
    # order. Measured 1.1e-4 absolute on a Xeon (MKL's sgemm), under 1e-4 on an EPYC; the bound is 2.3e-4.
    scale = logits["none"][1].abs().max().item()
    assert (logits["q4_1-exact"][1] - logits["none"][1]).abs().max().item() <= 1e-5 * scale
    assert torch.equal(logits["q4_1-exact"][1].argmax(-1), logits["none"][1].argmax(-1))


def test_q4_1_holds_a_fraction_of_the_weight_bytes_and_says_what_it_kept(q4_gguf: Path, mixed_gguf: Path) -> None:
    float_model, model = gguf_model(q4_gguf, "none"), gguf_model(q4_gguf, "q4_1")
    assert weight_bytes(model) < 0.3 * weight_bytes(float_model)
    assert sum(isinstance(m, BlockLinear) for m in model.modules()) == 4 * model.config.num_layers + 1
    assert model.quantization_detail.startswith("q4_1: 14 of 14 linear weights kept")
    model = gguf_model(mixed_gguf, "q4_1")
    # Per layer the file holds q, v, o, gate, down as Q4_1, k and up as F32: every part is kept (F32 as its
    # rows), q|k|v and gate|up as one linear of their parts (kept_weights.PartsLinear). q4_1 multiplies int8
    # activations on the quantized types only: F32 rows keep float ones.
    assert model.quantization_detail.startswith("q4_1: 14 of 14 linear weights kept")
    blocks = "4 F32, 10 Q4_1 (int8 activations), 1 Q8_0 (int8 activations)"
    assert model.quantization_detail.endswith(f"the file's blocks by type: {blocks}")
    assert model.lm_head is not None and model.lm_head.qs is model.embed_tokens.qs  # tied: one copy of the blocks


@pytest.mark.parametrize("quantization", ["q4_1", "q4_1-exact"])
def test_batch_composition_changes_no_decode_logit(q4_gguf: Path, quantization: str) -> None:
    model = gguf_model(q4_gguf, quantization)
    pool, allocator = make_pool(model.config)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (9, 14, 5)]
    contexts = [alloc(allocator, len(p) + 1) for p in prompts]
    for ids, context in zip(prompts, contexts):
        model(make_batch("extend", [(ids, context[:-1])]), pool)
    steps = [([7], context) for context in contexts]
    together = model(make_batch("decode", steps), pool)
    alone = torch.cat([model(make_batch("decode", [step]), pool) for step in steps])
    assert (together - alone).abs().max().item() <= 1e-6
    assert torch.equal(together.argmax(-1), alone.argmax(-1))


def test_a_bad_quantization_is_a_clear_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine.create(model_path=str(tiny_model_dir), max_total_tokens=64, quantization="q4")
    model = load_ours(tiny_model_dir)
    with pytest.raises(ValueError, match="quantization must be one of"):
        model.quantize("int4")
    assert model.quantization == "none" and isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)
    model.quantize("q4_1")
    with pytest.raises(ValueError, match="already quantized"):
        model.quantize("int8")


def test_engine_reports_the_resolved_quantization(tiny_model_dir: Path) -> None:
    info = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=64, quantization="q4_1").describe()
    assert info["quantization"] == "q4_1"
    assert info["quantization_detail"].startswith("q4_1: 0 of ")  # an HF float folder: everything quantized
    assert np.isfinite(info["weight_bytes"])


@needs_kernel
def test_the_rows_path_is_chosen_by_timing_and_can_be_turned_off() -> None:
    """choose_bf16_rows_path keeps the FMAs or the instruction (timed once; the same bits either way) and says
    which; the op turns the FMAs off and on again where they reproduce the CPU's vdpbf16ps."""
    chosen = choose_bf16_rows_path()
    try:
        assert not torch.ops.radixserve.block_linear_bf16_fma(False)
        reproduces = torch.ops.radixserve.block_linear_bf16_fma(True)
        assert reproduces or not chosen  # chosen only where the op can run them
    finally:
        torch.ops.radixserve.block_linear_bf16_fma(chosen)
    assert torch.ops.radixserve.block_linear_bf16_fma() == chosen
