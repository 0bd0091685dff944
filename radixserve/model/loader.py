"""load_model: a path (HF folder or .gguf file, or None for the embedded default) -> ready model.

No hub access ever: weights and tokenizer come from local files only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.gguf_loader import default_model_path, load_gguf, load_gguf_blocks
from radixserve.model.hf_loader import load_hf_folder
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.quant import BLOCK_QUANTIZATIONS
from radixserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    path: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer


def read_checkpoint(model_path: str | None) -> tuple[str, ModelConfig, dict[str, torch.Tensor]]:
    """The resolved path, config and HF-named float32 weights of an HF folder or a .gguf file."""
    path = model_path or default_model_path()
    if os.path.isdir(path):
        return (path, *load_hf_folder(path))
    if path.endswith(".gguf") and os.path.isfile(path):
        return (path, *load_gguf(path))
    raise FileNotFoundError(f"model_path {path!r} is neither an HF folder nor a .gguf file")


def load_model(
    model_path: str | None,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str = "auto",
    quantization: str = "none",
) -> LoadedModel:
    """Load weights, build the decoder on ``device`` in ``dtype`` (then quantize), and load the tokenizer."""
    path, config, weights = read_checkpoint(model_path)
    model = LlamaForCausalLM(config, device=device, dtype=dtype, attention_backend=attention_backend)
    model.load_weights(weights)
    del weights  # the float32 checkpoint: free it before quantizing makes more copies
    # q4_1 on a GGUF: the file's own Q4_1 / Q8_0 blocks are kept as they are (lossless).
    kept = load_gguf_blocks(path) if quantization in BLOCK_QUANTIZATIONS and path.endswith(".gguf") else None
    model.quantize(quantization, kept)
    model.eval()
    return LoadedModel(path, config, model, Tokenizer.from_model_path(path))
