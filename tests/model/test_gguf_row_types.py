"""A GGUF's matrices of every kept type run as the file stores them under ``--quantization auto`` (gguf_rows.py,
kept_weights.py): F16 / BF16 / F32 / Q5_0 / Q5_1 rows, Q4_0 / Q4_1 / Q8_0 blocks, a fused linear of mixed types;
what has no kernel is dequantized (never re-quantized) with a warning, or refused when it would not fit; the
per-type account in quantization_detail and /server_info.

The reference is our float32 model of the same file with every tensor dequantized by gguf (``load_gguf``): the
kept weights are exactly its values, so the logits differ only by float32 summation order (the residual added
after the matmul rather than inside it, the block kernels' order at decode)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from torch import nn

from radixserve import Engine
from radixserve.model import loader
from radixserve.model.gguf_loader import GGUFFile
from radixserve.model.gguf_rows import GGUFRowsEmbedding, GGUFRowsLinear
from radixserve.model.kept_weights import PartsLinear, TypeReport
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import load_model
from radixserve.model.precision import KEPT_TYPES
from radixserve.model.quant_blocks import BlockLinear
from radixserve.model.summary import format_summary
from tests.model.tiny import alloc, load_ours, make_batch, make_pool
from tests.support.archs import GGUF_DIR, SPECS, gguf_path
from tests.support.fidelity import fixture_prompt
from tests.support.gguf_rewrite import rewrite_gguf

CPU = torch.device("cpu")
ROW_CASES = ("F16", "BF16", "F32", "Q5_0", "Q5_1")  # F16: the committed fixture as the converter wrote it
# Per-layer linears of the mixed file (GGUF names): q and k Q5_0, v Q8_0 (as llama-quantize's Q4_K_M stores
# SmolLM2's), gate BF16 beside up Q5_1, o and down F16 (the fixture's own).
MIXED = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "ffn_gate": "BF16", "ffn_up": "Q5_1"}
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}
# Max |logit difference| over max |logit|: float32 summation order only. Measured with gguf_rows' placeholder
# (gguf's dequantize + F.linear): 0 (the same bits) for every row case, 3e-7 for the mixed file (its Q8_0 part
# through the block kernel at decode), 2.7-3.3e-7 for the llama-quantize K-quant files; the row kernels sum in
# their own order, within this bound.
BOUND = 1e-5


def restored(
    name: str, folder: Path, matrix_type: str | None = None, layer_types: dict[str, str] | None = None
) -> Path:
    """Fixture ``name`` with its matrices as ``matrix_type`` and the per-layer ones in ``layer_types`` as theirs."""
    if matrix_type in (None, "F16") and not layer_types:
        return gguf_path(name)
    layers = GGUFFile(gguf_path(name)).config.num_layers
    types = {f"blk.{i}.{t}.weight": q for i in range(layers) for t, q in (layer_types or {}).items()}
    return rewrite_gguf(gguf_path(name), folder / f"{name}-{matrix_type}-{len(types)}.gguf", matrix_type, types=types)


def run(model: LlamaForCausalLM, ids: list[int], new_tokens: int = 4) -> tuple[torch.Tensor, list[int]]:
    """Logits of every prompt position and of ``new_tokens`` greedy decode steps, and the greedy tokens."""
    pool, allocator = make_pool(model.config)
    context = alloc(allocator, len(ids) + new_tokens)
    rows = [model(make_batch("extend", [(ids, context[: len(ids)])]), pool, return_all_logits=True)]
    tokens = [int(rows[0][-1].argmax())]
    for step in range(len(ids), len(ids) + new_tokens):
        rows.append(model(make_batch("decode", [([tokens[-1]], context[: step + 1])]), pool))
        tokens.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows), tokens


def assert_runs_as_the_float_model(path: Path, model: LlamaForCausalLM) -> None:
    ids = fixture_prompt(20, model.config.vocab_size)
    (ours, our_tokens), (expected, tokens) = run(model, ids), run(load_ours(path), ids)
    assert (ours - expected).abs().max().item() <= BOUND * expected.abs().max().item()
    assert our_tokens == tokens


def linears(model: LlamaForCausalLM) -> list[nn.Module]:
    attn, mlp = ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")
    return [
        getattr(getattr(layer, o), a)
        for layer in model.layers
        for o, names in (("self_attn", attn), ("mlp", mlp))
        for a in names
    ]


@pytest.mark.parametrize("qtype", ROW_CASES)
def test_auto_keeps_every_matrix_as_the_files_rows(qtype: str, tmp_path: Path) -> None:
    path = restored("llama3", tmp_path, qtype)
    loaded = load_model(str(path), CPU, torch.float32, quantization="auto")
    model = loaded.model
    assert model.quantization == "q4_1-exact" and loaded.quantization_reason.startswith(
        f"auto: q4_1-exact, the GGUF stores its matrices as 15 {qtype}: kept as the file stores them, lossless"
    )
    rows = [m for m in linears(model) if isinstance(m, GGUFRowsLinear)]
    assert len(rows) == 4 * model.config.num_layers and {m.qtype for m in rows} == {qtype}
    assert isinstance(model.embed_tokens, GGUFRowsEmbedding) and isinstance(model.lm_head, GGUFRowsLinear)
    assert model.lm_head.raw is model.embed_tokens.raw  # tied: one buffer
    assert model.weights_by_type == {qtype: TypeReport(15, 15, 0, "", "")}
    assert model.quantization_detail.endswith(f"activations float; the file's blocks by type: 15 {qtype}")
    # The matrices take exactly the file's bytes (the rest: norms and the rotary table).
    file = GGUFFile(path)
    matrix_bytes = sum(int(t.n_bytes) for t in file.reader.tensors if len(t.shape) == 2)
    assert sum(m.raw.numel() for m in [*rows, model.embed_tokens]) == matrix_bytes
    assert_runs_as_the_float_model(path, model)


@pytest.mark.parametrize("name", [n for n in SPECS if n != "llama3"])
def test_every_architecture_keeps_its_f16_rows(name: str) -> None:
    """q/k rows un-permuted (llama, mistral), biases (qwen2), fused q|k|v and gate|up (phi3), gemma's norms."""
    model = load_model(str(gguf_path(name)), CPU, torch.float32, quantization="auto").model
    assert all(isinstance(m, GGUFRowsLinear) and m.qtype == "F16" for m in linears(model))
    assert isinstance(model.lm_head, GGUFRowsLinear)
    assert_runs_as_the_float_model(gguf_path(name), model)


def test_a_fused_linear_of_mixed_types_runs_as_its_parts(tmp_path: Path) -> None:
    path = restored("llama3-untied", tmp_path, None, MIXED)  # untied, with q/k/v biases split across the parts
    model = load_model(str(path), CPU, torch.float32, quantization="auto").model
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    assert isinstance(qkv, PartsLinear) and isinstance(gate_up, PartsLinear)
    q_k, v = qkv.parts
    assert isinstance(q_k, GGUFRowsLinear) and q_k.qtype == "Q5_0" and isinstance(v, BlockLinear)  # q|k: one
    assert q_k.bias is not None and v.bias is not None and q_k.out_features + v.out_features == qkv.out_features
    assert [getattr(p, "qtype", None) for p in gate_up.parts] == ["BF16", "Q5_1"]
    layers = model.config.num_layers
    assert model.weights_by_type == {
        "BF16": TypeReport(layers, layers, 0, "", ""),
        "F16": TypeReport(2 * layers + 2, 2 * layers + 2, 0, "", ""),  # o, down, the embedding, the lm_head
        "Q5_0": TypeReport(2 * layers, 2 * layers, 0, "", ""),
        "Q5_1": TypeReport(layers, layers, 0, "", ""),
        "Q8_0": TypeReport(layers, layers, 0, "", ""),
    }
    assert_runs_as_the_float_model(path, model)


def test_a_type_without_a_kernel_is_dequantized_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MXFP4 (gguf-py quantizes it; no kernel of ours runs it): v and down. auto dequantizes them to the model's
    dtype, and q, k (F16) with v, as their fused linear cannot be kept; explicit q4_1 re-quantizes them."""
    assert "MXFP4" in {t.name for t in gguf.quants._type_traits}
    path = restored("llama3", tmp_path, None, {"attn_v": "MXFP4", "ffn_down": "MXFP4"})
    with caplog.at_level(logging.WARNING, logger="radixserve.model.loader"):
        loaded = load_model(str(path), CPU, torch.float32, quantization="auto")
    assert "stored as 4 F16, 4 MXFP4 are not kept as stored: dequantized to float32" in caplog.text
    model, layers = loaded.model, loaded.config.num_layers
    assert "MXFP4 have no kernel: dequantized to floats, lossless" in loaded.quantization_reason
    layer = model.layers[0]
    assert type(layer.self_attn.qkv_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear
    assert isinstance(layer.mlp.gate_up_proj, GGUFRowsLinear)
    fused = "its fused linear has a part of a type not kept"
    assert model.weights_by_type == {
        "F16": TypeReport(11, 7, 4, "float32", fused),
        "MXFP4": TypeReport(2 * layers, 0, 2 * layers, "float32", "no kernel for MXFP4: dequantized (lossless)"),
    }
    assert model.quantization_detail.endswith(
        f"converted: 4 F16 to float32 ({fused}), 4 MXFP4 to float32 (no kernel for MXFP4: dequantized (lossless))"
    )
    assert_runs_as_the_float_model(path, model)
    explicit = load_model(str(path), CPU, torch.float32, quantization="q4_1-exact").model
    assert explicit.weights_by_type["MXFP4"].why == "no kernel for MXFP4: re-quantized (lossy)"
    assert isinstance(explicit.layers[0].mlp.down_proj, BlockLinear)


def test_auto_refuses_a_float_copy_that_would_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = restored("llama3", tmp_path, None, {"ffn_down": "MXFP4"})
    monkeypatch.setattr(loader.psutil, "virtual_memory", lambda: SimpleNamespace(available=100_000))
    with pytest.raises(ValueError, match=r"stored as 2 MXFP4 .*float copy needs 0\.00 GiB, over 80% of the 0\.00 GiB"):
        load_model(str(path), CPU, torch.float32, quantization="auto")
    load_model(str(restored("llama3", tmp_path, "Q5_0")), CPU, torch.float32, quantization="auto")  # all kept


def test_server_info_reports_each_type_and_the_files_bytes() -> None:
    info = Engine.create(model_path=str(gguf_path("llama3")), max_total_tokens=64, dtype="float32").describe()
    assert info["resolved_quantization"] == "q4_1-exact"
    assert info["weights_by_type"] == {
        "F16": {"matrices": 15, "kept": 15, "converted": 0, "converted_to": "", "why": "", "activations": "float"}
    }
    assert info["file_tensor_bytes"] == GGUFFile(gguf_path("llama3")).tensor_bytes()
    assert info["weight_bytes_ratio"] == round(info["weight_bytes"] / info["file_tensor_bytes"], 4)
    assert 0.95 <= info["weight_bytes_ratio"] <= 1.05  # the bound: resident weights <= 1.05x the file's
    assert "by GGUF type: 15 F16 kept" in format_summary(info)


def k_quant_fixtures() -> list[Path]:
    """The committed llama-quantize fixtures holding K-quant matrices (hidden 256: whole super-blocks of 256)."""
    found = [
        p
        for p in sorted(GGUF_DIR.glob("*.gguf"))
        if K_QUANTS & {t.tensor_type.name for t in gguf.GGUFReader(p).tensors}
    ]
    return found or [pytest.param(None, marks=pytest.mark.skip(reason="no K-quant fixture in tests/fixtures/gguf"))]


@pytest.mark.parametrize("path", k_quant_fixtures(), ids=lambda p: getattr(p, "stem", "none"))
def test_llama_quantize_files_keep_their_k_quant_rows(path: Path) -> None:
    """Real llama-quantize files (Q4_K_M mixes K-quants with Q5_0 / Q8_0 / F16 and Q6_K heads): under auto every
    matrix of a kept type runs as stored, K-quant ones as GGUFRows; logits as the float32 model of the file."""
    model = load_model(str(path), CPU, torch.float32, quantization="auto").model
    types = GGUFFile(path).weight_types()
    assert model.weights_by_type and all(
        report.kept == (report.matrices if qtype in KEPT_TYPES else 0)
        for qtype, report in model.weights_by_type.items()
    )
    rows = {m.qtype for m in model.modules() if isinstance(m, (GGUFRowsLinear, GGUFRowsEmbedding))}
    assert K_QUANTS & set(types.values()) <= rows
    assert_runs_as_the_float_model(path, model)
