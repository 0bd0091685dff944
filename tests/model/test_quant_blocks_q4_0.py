"""A GGUF's Q4_0 blocks kept as they are (18 bytes a block) and run by the Q4_1 kernels with m = -8d made from d."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixserve.model.gguf_loader import GGUFFile, load_gguf, load_gguf_blocks
from radixserve.model.invariance import make_split_invariant
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import load_model
from radixserve.model.precision import resolve_quantization
from radixserve.model.quant import weight_bytes
from radixserve.model.quant_blocks import KERNEL_MAX_ROWS, BlockEmbedding, BlockLinear, QuantBlocks
from tests.model.test_gguf import _write_tiny_llama
from tests.model.test_quant_blocks import needs_kernel
from tests.model.tiny import alloc, make_batch, make_pool

Q4_0, Q4_1, Q8_0, F32 = (gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0", "F32"))
CPU = torch.device("cpu")


def random_q4_0(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Random valid Q4_0 bytes [N, K / 32 * 18]: any codes, float16 scales of both signs over 2^-20 .. 2^6
    (subnormal ones included, as a file may hold) and some zero."""
    rng = np.random.default_rng(seed)
    blocks = out_features * in_features // 32
    d = (rng.choice([-1.0, 1.0], blocks) * 2.0 ** rng.uniform(-20, 6, blocks)).astype(np.float16)
    d[rng.random(blocks) < 0.02] = 0
    codes = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(blocks, 2), codes], axis=1)
    return raw.reshape(out_features, -1)


def as_q4_1(blocks: QuantBlocks) -> QuantBlocks:
    """The same weights as Q4_1 blocks: m = -8d stored (the reference the native Q4_0 path must match)."""
    return QuantBlocks(blocks.qs, blocks.d, blocks.mins())


def test_q4_0_blocks_are_the_files_bytes_and_dequantize_to_gguf_own_values() -> None:
    for raw in (random_q4_0(37, 160, seed=1), gguf.quants.quantize(np.random.randn(37, 160).astype(np.float32), Q4_0)):
        blocks = QuantBlocks.from_gguf(raw, "q4_0", "Q4_0")
        expected = torch.from_numpy(gguf.quants.dequantize(raw, Q4_0))
        assert blocks.fmt == "q4_0" and blocks.source == "Q4_0" and blocks.m is None
        assert sum(t.numel() * t.element_size() for t in (blocks.qs, blocks.d)) == raw.nbytes  # 18 bytes a block
        assert torch.equal(blocks.dequantize(), expected)
        assert torch.equal(blocks.dequantize_fast(), expected)  # the C++ dequantization where it builds
        assert torch.equal(as_q4_1(blocks).dequantize(), expected)  # m = -8d: exact


def test_a_scale_whose_min_overflows_float16_runs_but_never_becomes_q4_1() -> None:
    """-8d of a d over 8,188 has no float16: fine for Q4_0 (the kernels make it in float32), refused where a
    Q4_0 part would join Q4_1 parts in one fused weight."""
    raw = random_q4_0(2, 32, seed=2)
    raw[0, :2] = np.array([10_000.0], dtype=np.float16).view(np.uint8)
    blocks = QuantBlocks.from_gguf(raw, "q4_0")
    assert torch.equal(blocks.dequantize_fast(), torch.from_numpy(gguf.quants.dequantize(raw, Q4_0)))
    with pytest.raises(ValueError, match="over 8188"):
        blocks.mins()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 11, 16, 40])  # 40: past the kernel, dequantized tiles + the GEMM
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 160), (64, 32), (5, 1536)])
def test_block_linear_on_q4_0_equals_gguf_dequantize_then_matmul(
    rows: int, out_features: int, in_features: int
) -> None:
    """As test_quant_blocks.py promises for Q4_1: the kernel within float32 rounding of the float64 matmul on
    gguf's own dequantized weights, a row's bits alone as in its batch; past the kernel F.linear's bits."""
    raw = random_q4_0(out_features, in_features, seed=rows)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, Q4_0))
    generator = torch.Generator().manual_seed(100 + rows)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 2
    layer = BlockLinear(QuantBlocks.from_gguf(raw, "q4_0"), bias, torch.float32)
    got = layer(x)
    expected = F.linear(x.double(), weight.double(), bias.double())
    scale = x.abs().sum(-1, keepdim=True).double() * weight.abs().max().double()
    assert ((got.double() - expected).abs() / scale).max().item() <= 1e-6
    if rows <= KERNEL_MAX_ROWS:
        for r in (0, rows - 1):
            assert torch.equal(layer(x[r : r + 1]), got[r : r + 1])
    else:
        assert torch.equal(got, F.linear(x, weight, bias))
    assert torch.equal(BlockLinear(as_q4_1(layer.blocks), bias, torch.float32)(x), got)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40, 64])
def test_native_q4_0_has_the_bits_of_q4_1_blocks_with_m_stored(
    dtype: torch.dtype, int8_activations: bool, rows: int
) -> None:
    """Every kernel path (decode tiles, bfloat16 decoded chunks past 8 rows, int8 activations up to 48 rows,
    the dequantized tiles, the residual add) makes Q4_0's mins as -8d: the same bits as Q4_1 blocks storing
    them. 37 channels of 576: chunks and a partial one, 18 blocks: a group of 16 and a partial one."""
    blocks = QuantBlocks.from_gguf(random_q4_0(37, 576, seed=rows), "q4_0")
    generator = torch.Generator().manual_seed(300 + rows)
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    residual = torch.randn(rows, 37, generator=generator).to(dtype)
    native = BlockLinear(blocks, None, dtype, int8_activations)
    stored = BlockLinear(as_q4_1(blocks), None, dtype, int8_activations)
    if int8_activations and torch.ops.radixserve.block_q8_panels():
        # The VNNI kernel folds Q4_0's -8 into its integer dot products ((q - 8) . x, exact) where Q4_1 blocks
        # add m * (s * sum x) in float: equal within float rounding (test_quant_blocks_int8_gemm.py pins both).
        scale = x.float().abs().sum(-1, keepdim=True) * blocks.dequantize().abs().max()
        assert ((native(x).float() - stored(x).float()).abs() / scale).max() <= (
            1e-2 if dtype == torch.bfloat16 else 1e-6
        )
        return
    assert torch.equal(native(x), stored(x))
    assert torch.equal(native.forward_add(x, residual), stored.forward_add(x, residual))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 9, 16, 40])
def test_bfloat16_q4_0_equals_the_bfloat16_weights(rows: int) -> None:
    """bfloat16 rows: the decode kernel multiplies gguf's exact values, the GEMM path (more rows) those values
    rounded to bfloat16, as the bfloat16 float model holds them."""
    raw = random_q4_0(37, 576, seed=rows)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, Q4_0)).bfloat16()
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = BlockLinear(QuantBlocks.from_gguf(raw, "q4_0"), None, torch.bfloat16)(x)
    expected = F.linear(x.float(), weight.float())
    assert got.dtype == torch.bfloat16
    assert ((got.float() - expected).abs() / (x.float().abs() @ weight.float().abs().t())).max().item() <= 2**-7
    if rows > KERNEL_MAX_ROWS:
        assert torch.equal(got, F.linear(x, weight))


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with every layer matrix Q4_0, the embedding (tied lm_head) Q8_0: as llama-quantize Q4_0
    stores SmolLM2 (its tied embedding falls back from Q6_K to Q8_0 at a 576-wide row)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_0.gguf"
    _write_tiny_llama(path, layer_types={Q8_0: Q4_0, F32: Q4_0})
    return path


@pytest.fixture(scope="module")
def q4_mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per layer q, v, o, gate, down Q4_0; k and up Q4_1; the embedding Q8_0: every type kept, fused in one."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_0-q4_1.gguf"
    _write_tiny_llama(path, layer_types={Q8_0: Q4_0, F32: Q4_1})
    return path


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny GGUFs carry no vocabulary: these tests are about weights."""
    monkeypatch.setattr("radixserve.model.loader.Tokenizer.from_model_path", lambda path, gguf_reader=None: None)


def gguf_model(path: Path, quantization: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config, tensors = load_gguf(path)
    model = LlamaForCausalLM(config, dtype=dtype)
    model.load_weights(tensors)
    model.quantize(quantization, load_gguf_blocks(path) if quantization != "none" else None)
    return model


def test_the_files_q4_0_blocks_are_kept_and_dequantize_to_its_floats(q4_0_gguf: Path) -> None:
    _, tensors = load_gguf(q4_0_gguf)
    kept = load_gguf_blocks(q4_0_gguf)
    assert kept["model.layers.0.self_attn.q_proj.weight"].source == "Q4_0"  # rows un-permuted as the floats are
    assert kept["model.embed_tokens.weight"].source == "Q8_0"
    for name, blocks in kept.items():
        assert torch.equal(blocks.dequantize(), tensors[name]), name


@pytest.mark.parametrize("name", ["q4_0_gguf", "q4_mixed_gguf"])
def test_auto_keeps_q4_0_and_says_so_per_type(name: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(name)
    method, reason = resolve_quantization("auto", CPU, GGUFFile(path).matrix_types(), block_kernel=True)
    assert method == "q4_1-exact" and "Q4_0 by the Q4_1 kernels with m = -8d" in reason
    loaded = load_model(str(path), CPU, torch.float32, quantization="auto")
    if loaded.model.quantization != "q4_1-exact":  # no compiler: the block kernel did not build
        assert "did not build" in loaded.quantization_reason
        return
    detail = loaded.model.quantization_detail
    assert detail.startswith("q4_1-exact: 14 of 14 linear weights kept") and "lm_head kept as q8_0" in detail
    q4_0, q4_1 = (10, 4) if name == "q4_mixed_gguf" else (14, 0)
    listing = f"{q4_0} Q4_0" + (f", {q4_1} Q4_1" if q4_1 else "")
    assert detail.endswith(f"the file's blocks by type: {listing}, 1 Q8_0")


def test_resident_weights_are_the_files_bytes(q4_0_gguf: Path) -> None:
    """Q4_0 blocks stay 18 bytes (no stored min), Q8_0 34: the block weights are the file's tensor bytes."""
    file = GGUFFile(q4_0_gguf)
    block_bytes = sum(int(t.n_bytes) for t in file.reader.tensors if t.tensor_type in (Q4_0, Q8_0))
    model = gguf_model(q4_0_gguf, "q4_1-exact")
    kept = [m for m in model.modules() if isinstance(m, (BlockLinear, BlockEmbedding)) and m is not model.lm_head]
    assert sum(t.numel() * t.element_size() for m in kept for t in m.buffers()) == block_bytes
    assert weight_bytes(model) < 0.3 * weight_bytes(gguf_model(q4_0_gguf, "none"))


def test_q4_0_runs_exactly_the_float_model_at_prefill_and_closely_at_decode(q4_0_gguf: Path) -> None:
    """Mirrors test_quant_blocks.py's Q4_1 test: prefill rows the float model's bits, decode within its bound."""
    ids = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for quantization in ("none", "q4_1-exact"):
        model = gguf_model(q4_0_gguf, quantization)
        pool, allocator = make_pool(model.config)
        context = alloc(allocator, 24)
        prefill = model(make_batch("extend", [(ids[:20], context[:20])]), pool, return_all_logits=True)
        decode = [model(make_batch("decode", [([ids[t]], context[: t + 1])]), pool) for t in range(20, 24)]
        logits[quantization] = (prefill, torch.cat(decode))
    assert isinstance(gguf_model(q4_0_gguf, "q4_1-exact").embed_tokens, BlockEmbedding)
    assert torch.equal(logits["q4_1-exact"][0][:-1], logits["none"][0][:-1])  # the last row's lm_head: the kernel
    scale = logits["none"][1].abs().max().item()
    assert (logits["q4_1-exact"][1] - logits["none"][1]).abs().max().item() <= 1e-5 * scale
    assert torch.equal(logits["q4_1-exact"][1].argmax(-1), logits["none"][1].argmax(-1))


def greedy(model: LlamaForCausalLM, prompt: list[int], cached_len: int, new_tokens: int) -> list[int]:
    """Greedy tokens after ``prompt``: its first ``cached_len`` tokens prefilled first (a cache hit's prefix),
    the rest extended on them; 0: one cold prefill."""
    pool, allocator = make_pool(model.config)
    context = alloc(allocator, len(prompt) + new_tokens)
    if cached_len:
        model(make_batch("extend", [(prompt[:cached_len], context[:cached_len])]), pool)
    logits = model(make_batch("extend", [(prompt[cached_len:], context[: len(prompt)])]), pool)
    out = [int(logits.argmax(-1))]
    for t in range(len(prompt), len(prompt) + new_tokens - 1):
        out.append(int(model(make_batch("decode", [([out[-1]], context[: t + 1])]), pool).argmax(-1)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_hit_gives_the_cold_runs_greedy_tokens(q4_0_gguf: Path, dtype: torch.dtype) -> None:
    """float32: the decode kernel and the tiled GEMM multiply by the same weights, in another order; bfloat16: the
    decode kernel multiplies by exact codes and the GEMM by bfloat16 weights, so only split invariance (the
    engine's default: one kernel at every row count) keeps a cache hit's answer."""
    model = gguf_model(q4_0_gguf, "q4_1-exact", dtype)
    if dtype == torch.bfloat16:
        assert make_split_invariant(model)[0]
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    cold = greedy(model, prompt, 0, 12)
    assert greedy(model, prompt, 32, 12) == cold
    assert greedy(model, prompt, 39, 12) == cold  # a one-token tail: the decode kernel's path
