"""An HF ``config.json`` -> ModelConfig's fields: which architecture, and its named differences.

transformers 5 writes ``rope_parameters`` (per layer type for gemma3) and ``layer_types``; older configs write
``rope_scaling`` / ``rope_theta`` / ``rope_local_base_freq`` and leave the layer pattern implicit. Both are read;
the implicit patterns are transformers' own defaults for each family.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
GEMMA = ("gemma2", "gemma3")


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's keyword arguments from a parsed ``config.json``; ValueError for what we do not implement."""
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs}; supported: {sorted(HF_ARCHITECTURES)}")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (an embedding model) is not supported: causal decoders only")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    eos = hf.get("eos_token_id")
    return {
        "architecture": arch,
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": num_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 8192)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", arch in GEMMA)),
        "attention_bias": arch == "qwen2" or bool(hf.get("attention_bias", False)),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_ids": tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        **_rope_fields(hf, arch),
        **_window_fields(hf, arch),
        **_family_fields(hf, arch),
    }


def _rope_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """rope_theta and rope_scaling (of the full-attention layers), and gemma3's sliding layers' theta."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local: dict[str, Any] | None = None
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5, per layer type
        local = params.get("sliding_attention")
        params = dict(params.get("full_attention") or {})
    theta = hf.get("rope_theta", params.get("rope_theta"))
    partial = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported (1.0 only)")
    scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    fields: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10_000.0), "rope_scaling": scaling}
    if arch == "gemma3":
        if local and local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(
                f"gemma3 sliding layers' rope type {local.get('rope_type')!r}: only 'default' is supported"
            )
        local_theta = hf.get("rope_local_base_freq", (local or {}).get("rope_theta", 10_000.0))
        fields["rope_local_base_freq"] = float(local_theta)
    return fields


def _default_layer_types(hf: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    """transformers' pattern where the config names none: gemma2 alternates (sliding first), gemma3 has one
    global layer in ``sliding_window_pattern`` (6), qwen slides from ``max_window_layers`` on, mistral and phi3
    slide everywhere."""
    if arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif arch == "gemma3":
        pattern = int(hf.get("sliding_window_pattern", 6))
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif arch in ("qwen2", "qwen3"):
        sliding = [i >= int(hf.get("max_window_layers", num_layers)) for i in range(num_layers)]
    else:
        sliding = [arch in ("mistral", "phi3")] * num_layers
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _window_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    if arch == "llama" or (arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False)):
        window = None
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or _default_layer_types(hf, arch, num_layers)
    return window_fields(window, layer_types, int(hf.get("max_position_embeddings", 8192)))


def window_fields(window: int | None, layer_types: list[str], context_len: int) -> dict[str, Any]:
    """ModelConfig's sliding_window and layer_types; none at all where no layer's window can mask a key (no
    window, one as long as the context, no sliding layer): those models keep every attention path."""
    if not window or int(window) >= context_len or "sliding_attention" not in layer_types:
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": int(window), "layer_types": tuple(layer_types)}


def _family_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """qk_norm, the activation, and gemma's differences (norms, scales, soft-capping)."""
    fields: dict[str, Any] = {
        "qk_norm": arch in ("qwen3", "gemma3"),
        "hidden_act": str(hf.get("hidden_act") or "silu"),
    }
    if arch in GEMMA:
        scalar = hf.get("query_pre_attn_scalar")
        fields.update(
            hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"),
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            attn_logit_softcapping=_optional_float(hf.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
            scale_embeddings=True,
            norm_unit_offset=True,
            sandwich_norms=True,
        )
    return fields


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
