"""GGUF metadata -> ModelConfig, and each GGUF architecture's tensor names and storage conventions.

What llama.cpp's convert_hf_to_gguf.py does per architecture (read from its source, llama-cpp-python 0.3.36),
undone by gguf_loader so its tensors are the HF checkpoint's:

    llama   (also Mistral and Llama 3.x: they convert as llama) q/k rows permuted (and their biases);
            llama3 rope as a ``rope_freqs`` tensor of per-frequency factors, not metadata
    qwen2   q/k/v biases; qwen3: q/k norms; phi3: fused attn_qkv, ffn_up holding gate|up
    gemma2  norms stored as 1 + w; four norms per layer; soft-capping and the window as metadata;
    gemma3  the same, q/k norms, rope.freq_base_swa for the sliding layers

What the converter does not write, llama.cpp fixes per architecture at load, and so do we: gemma2 alternates
sliding and global layers, gemma3 has one global layer in 6, and gemma's attention scale is head_dim ** -0.5
except for the 27B models (hidden / heads), llama.cpp's rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from radixserve.model.config import ModelConfig
from radixserve.model.hf_config import window_fields

_MISSING = object()
_LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF ``general.architecture``: our architecture, its layer tensors (GGUF ``blk.N.<name>`` -> HF
    ``model.layers.N.<name>``), and how the converter stored them."""

    architecture: str
    layer_names: dict[str, str] = field(hash=False)
    permute_qk: bool = False  # q/k rows in llama.cpp's interleaved rotary layout
    norm_unit_offset: bool = False  # norms stored as 1 + w (gemma)
    sliding_pattern: int = 0  # every n-th layer global, the others sliding (llama.cpp's swa pattern); 0: none


GGUF_ARCHS = {
    "llama": GGUFArch("llama", _LLAMA_LAYER, permute_qk=True),
    "qwen2": GGUFArch("qwen2", _LLAMA_LAYER),
    "qwen3": GGUFArch("qwen3", {**_LLAMA_LAYER, **_QK_NORM}),
    "phi3": GGUFArch("phi3", _PHI3_LAYER),
    "gemma2": GGUFArch("gemma2", {**_LLAMA_LAYER, **_GEMMA_NORMS}, norm_unit_offset=True, sliding_pattern=2),
    "gemma3": GGUFArch(
        "gemma3", {**_LLAMA_LAYER, **_GEMMA_NORMS, **_QK_NORM}, norm_unit_offset=True, sliding_pattern=6
    ),
}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp: these scale q by (hidden / heads) ** -0.5


def gguf_arch(reader: gguf.GGUFReader) -> GGUFArch:
    name = field_value(reader, "general.architecture")
    if name not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {name!r} (supported: {sorted(GGUF_ARCHS)})")
    return GGUF_ARCHS[name]


def field_value(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    found = reader.get_field(key)
    if found is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return default
    return found.contents()


def config_from_reader(reader: gguf.GGUFReader) -> ModelConfig:
    """The ModelConfig of an open GGUF, from its metadata (and its ``rope_freqs`` tensor, if any)."""
    arch = gguf_arch(reader)
    name = str(field_value(reader, "general.architecture"))

    def key(suffix: str, default: Any = _MISSING) -> Any:
        return field_value(reader, f"{name}.{suffix}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight")
    hidden, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dims = key("rope.dimension_count", None)
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} head dims) are not supported")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id", None)
    bos = field_value(reader, "tokenizer.ggml.bos_token_id", None)
    num_layers, context = int(key("block_count")), int(key("context_length", 8192))
    return ModelConfig(
        architecture=arch.architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF dims are reversed: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(key("rope.freq_base", 10_000.0)),
        rope_scaling=_rope_scaling(key),
        rope_freq_factors=_rope_freq_factors(tensors),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        qk_norm="attn_q_norm" in arch.layer_names,
        **window_fields(key("attention.sliding_window", None), _layer_types(arch, key, num_layers), context),
        **_gemma_fields(arch, key, hidden, num_heads, head_dim, num_layers),
    )


def _layer_types(arch: GGUFArch, key: Any, num_layers: int) -> list[str]:
    """``{arch}.attention.sliding_window_pattern`` where the file has it (a bool per layer, or a period), else
    gemma's fixed patterns (llama.cpp's set_swa_pattern: sliding unless the layer ends a pattern); every
    layer sliding for the others, where a file names a window at all (phi3 does)."""
    pattern = key("attention.sliding_window_pattern", arch.sliding_pattern)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        sliding = [bool(s) for s in pattern]
    else:
        pattern = int(pattern)
        sliding = [not pattern or i % pattern < pattern - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma_fields(arch: GGUFArch, key: Any, hidden: int, num_heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    if not arch.norm_unit_offset:
        return {}
    scale = key("attention.scale", None)
    scalar: float = float(head_dim)
    if scale is not None:
        scalar = float(scale) ** -2
    elif _GEMMA_27B_LAYERS[arch.architecture] == layers:
        scalar = float(hidden // num_heads)
    fields: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _optional_f32(key("attn_logit_softcapping", None)),
        "final_logit_softcapping": _optional_f32(key("final_logit_softcapping", None)),
        "scale_embeddings": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
    }
    if arch.architecture == "gemma3":
        fields["rope_local_base_freq"] = _f32(key("rope.freq_base_swa", 10_000.0))  # llama.cpp's default
    return fields


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. Keep the shortest
    decimal that rounds to the same float32, so configs compare equal to HF's ``config.json``."""
    return float(str(np.float32(value)))


def _optional_f32(value: float | None) -> float | None:
    return None if value is None or value == 0 else _f32(value)


def _rope_scaling(key: Any) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` from ``{arch}.rope.scaling.*``; ModelConfig rejects types we lack."""
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(key("rope.scaling.factor", 1.0))}
    orig = key("rope.scaling.original_context_length", None)
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _rope_freq_factors(tensors: dict[str, Any]) -> tuple[float, ...] | None:
    """The ``rope_freqs.weight`` tensor (llama3 rope as the converter writes it): a divisor per frequency."""
    info = tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.tensor_type != gguf.GGMLQuantizationType.F32:
        raise ValueError(f"rope_freqs.weight stored as {info.tensor_type.name}: F32 expected")
    return tuple(float(x) for x in np.asarray(info.data, dtype=np.float32).reshape(-1))
