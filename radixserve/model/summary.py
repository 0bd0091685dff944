"""What a load found, in a few named fields: for the start-up log and /server_info (Engine.describe).

architecture gemma3 | 26 layers | heads 8, kv heads 4, head dim 256 | context 131072
rope theta 1e+06, linear {'factor': 8.0}; sliding layers theta 10000, default
sliding window 512 (22 sliding, 4 full) | tokenizer BPE (GGUF) | chat template: the GGUF
weights 1.9 GiB (bfloat16, q4_1-exact); the file's tensors 1.9 GiB (1.00x)
by GGUF type: 183 Q4_K kept, 26 Q6_K kept; 1 IQ4_NL to bfloat16 (no kernel for IQ4_NL: dequantized (lossless))
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from radixserve.model.config import ModelConfig
from radixserve.model.quant import weight_bytes
from radixserve.model.tokenizer import Tokenizer


def describe_model(
    config: ModelConfig, tokenizer: Tokenizer, model: Any, file_tensor_bytes: int | None = None
) -> dict[str, Any]:
    """The model's fields of Engine.describe(): architecture, shape, rope, window, tokenizer, weights: the bytes
    they take resident (``weight_bytes``) next to a GGUF's tensor bytes (``file_tensor_bytes``, None for an HF
    folder) and their ratio, and per GGUF type how many matrices run as stored and how many were converted, why."""
    resident = weight_bytes(model)
    return {
        "architecture": config.architecture,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope": config.rope_summary(),
        "sliding_window": config.sliding_window,
        "layer_types": layer_types_summary(config),
        "tokenizer_kind": tokenizer.kind,
        "chat_template_source": tokenizer.chat_template_source,
        "weight_bytes": resident,
        "file_tensor_bytes": file_tensor_bytes,
        "weight_bytes_ratio": round(resident / file_tensor_bytes, 4) if file_tensor_bytes else None,
        "weights_by_type": {qtype: asdict(report) for qtype, report in model.weights_by_type.items()},
    }


def layer_types_summary(config: ModelConfig) -> str:
    """ "all full", or how many layers slide: "5 sliding, 1 full"."""
    sliding = sum(config.is_sliding(i) for i in range(config.num_layers))
    return "all full" if not sliding else f"{sliding} sliding, {config.num_layers - sliding} full"


def format_summary(info: dict[str, Any]) -> str:
    """describe()'s model fields as the start-up log's lines."""
    file_bytes, by_type = info.get("file_tensor_bytes"), info.get("weights_by_type") or {}
    on_file = (
        f"; the file's tensors {file_bytes / 2**20:.1f} MiB ({info['weight_bytes_ratio']:.2f}x)" if file_bytes else ""
    )
    window = "none" if not info["sliding_window"] else f"{info['sliding_window']} ({info['layer_types']})"
    return (
        f"model {info['resolved_model_path']}: architecture {info['architecture']}, {info['num_layers']} layers, "
        f"heads {info['num_heads']}, kv heads {info['num_kv_heads']}, head dim {info['head_dim']}, "
        f"context {info['context_length']}\n"
        f"  rope {info['rope']}; sliding window {window}\n"
        f"  tokenizer {info['tokenizer_kind']}; chat template: {info['chat_template_source']}\n"
        f"  weights {info['weight_bytes'] / 2**20:.1f} MiB ({info['resolved_dtype']}, "
        f"quantization {info['resolved_quantization']}){on_file}"
        + (f"\n  by GGUF type: {types_summary(by_type)}" if by_type else "")
        + (f"\n  {info['split_invariant_reason']}" if "split_invariant_reason" in info else "")
    )


def types_summary(by_type: dict[str, dict[str, Any]]) -> str:
    """``weights_by_type`` in a line: "14 Q5_0 kept (int8 activations); 2 MXFP4 to bfloat16 (why)"."""
    parts = [
        f"{row['kept']} {qtype} kept" + (" (int8 activations)" if row.get("activations") == "int8" else "")
        for qtype, row in by_type.items()
        if row["kept"]
    ]
    parts += [
        f"{row['converted']} {qtype} to {row['converted_to']} ({row['why']})"
        for qtype, row in by_type.items()
        if row["converted"]
    ]
    return "; ".join(parts)
