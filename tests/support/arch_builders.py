"""Tiny random models of every architecture (transformers' own classes), and GGUF files made from them.

``build_arch_model`` extends tiny_model.build_hf_model to qwen3, phi3, gemma2 and gemma3 (same sizes,
norms and biases perturbed so a swapped norm or a dropped bias shows in the logits).

``write_gguf`` writes an HF folder as llama.cpp's convert_hf_to_gguf.py does for these architectures (read
from its source, llama-cpp-python 0.3.36: conversion/llama.py, qwen.py, phi.py, gemma.py), so the tests need
no converter: names from gguf-py's own tensor map; q/k rows (and biases) permuted for llama only (its
``undo_permute``; mistral converts as llama); gemma norms stored as 1 + w; llama3 rope as a ``rope_freqs``
tensor of per-frequency factors; gemma2's soft-capping and sliding window, gemma3's swa rope base and
phi3's sliding window as metadata. No tokenizer: these files feed gguf_loader, not an engine.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from tests.support.tiny_model import TINY

CONFIGS: dict[str, Any] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "original_max_position_embeddings": 256},
    # eager: transformers' reference for soft-capped attention
    "gemma2": {"attn_implementation": "eager", "sliding_window": 8, "query_pre_attn_scalar": 24},
    "gemma3": {"sliding_window": 8, "query_pre_attn_scalar": 24},
}


def build_arch_model(arch: str, folder: Path, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random tiny ``arch`` model, float32, eval mode, saved as safetensors into ``folder``."""
    kwargs = {**TINY, **DEFAULTS[arch], "tie_word_embeddings": False, **overrides}
    attn = kwargs.pop("attn_implementation", None)
    hf_config = CONFIGS[arch](**kwargs)
    if attn is not None:
        hf_config._attn_implementation = attn
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
GGUF_ARCH.update(gemma2="gemma2", gemma3="gemma3")


def write_gguf(model: PreTrainedModel, folder: Path, path: Path, arch: str, matrix_type: str = "F32") -> Path:
    """The HF folder ``folder`` (of ``model``, config ``arch``) as a GGUF at ``path``; 2-D weights as
    ``matrix_type`` (F32, F16, Q8_0, Q4_K, ...), norms and biases F32 (as the converter keeps 1-D tensors)."""
    hp = model.config
    name = GGUF_ARCH[arch]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == name)
    writer = gguf.GGUFWriter(str(path), name)
    _write_metadata(writer, hp, arch)
    tensors = load_file(str(folder / "model.safetensors"))
    tmap = gguf.get_tensor_name_map(model_arch, hp.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for hf_name, tensor in tensors.items():
        data = _converted(hf_name, tensor.float(), hp, name)
        gguf_name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        array = data.numpy()
        kind = qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    if (factors := _llama3_factors(hp)) is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _converted(hf_name: str, data: torch.Tensor, hp: Any, gguf_arch: str) -> torch.Tensor:
    """The converter's modify_tensors: llama's q/k permutation, gemma's 1 + w norms."""
    if gguf_arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        heads = hp.num_attention_heads if ".q_proj." in hf_name else hp.num_key_value_heads
        shape = data.shape
        data = data.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    if gguf_arch.startswith("gemma") and hf_name.endswith("norm.weight"):
        data = data + 1
    return data.contiguous()


def _rope(hp: Any) -> dict[str, Any]:
    params = dict(getattr(hp, "rope_parameters", None) or {})
    return dict(params.get("full_attention", params))


def _write_metadata(writer: gguf.GGUFWriter, hp: Any, arch: str) -> None:
    writer.add_block_count(hp.num_hidden_layers)
    writer.add_context_length(hp.max_position_embeddings)
    writer.add_embedding_length(hp.hidden_size)
    writer.add_feed_forward_length(hp.intermediate_size)
    writer.add_head_count(hp.num_attention_heads)
    writer.add_head_count_kv(hp.num_key_value_heads)
    writer.add_layer_norm_rms_eps(hp.rms_norm_eps)
    if getattr(hp, "head_dim", None):
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    rope = _rope(hp)
    writer.add_rope_freq_base(rope.get("rope_theta", 10_000.0))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hp.attn_logit_softcapping)
        writer.add_final_logit_softcapping(hp.final_logit_softcapping)
        writer.add_sliding_window(hp.sliding_window)
    if arch == "gemma3":
        if hp.final_logit_softcapping:
            writer.add_final_logit_softcapping(hp.final_logit_softcapping)
        writer.add_sliding_window(hp.sliding_window)
        writer.add_rope_freq_base_swa(hp.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        writer.add_rope_dimension_count(hp.hidden_size // hp.num_attention_heads)
        writer.add_sliding_window(hp.sliding_window or 0)
    if hp.bos_token_id is not None:
        writer.add_bos_token_id(hp.bos_token_id)
    eos = hp.eos_token_id
    if eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)


def _llama3_factors(hp: Any) -> np.ndarray | None:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: llama3 rope as per-frequency factors."""
    rope = _rope(hp)
    if hp.model_type not in ("llama", "mistral") or rope.get("rope_type") != "llama3":
        return None
    base, dim = rope.get("rope_theta", 10_000.0), hp.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
