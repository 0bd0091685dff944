"""load_model: a path (HF folder or .gguf file, or None for the embedded default) -> ready model.

No hub access ever: weights and tokenizer come from local files only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.gguf_loader import GGUFFile, default_model_path
from radixserve.model.hf_loader import load_hf_folder
from radixserve.model.llama import LlamaForCausalLM, usable_blocks
from radixserve.model.precision import resolve_quantization
from radixserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    path: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    quantization_reason: str  # why the model has its quantization (what auto chose, and why)


def checkpoint_path(model_path: str | None) -> str:
    """``model_path`` (None: the embedded default) checked to be an HF folder or a .gguf file."""
    path = model_path or default_model_path()
    if os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path)):
        return path
    raise FileNotFoundError(f"model_path {path!r} is neither an HF folder nor a .gguf file")


def load_model(
    model_path: str | None,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str = "auto",
    quantization: str = "auto",
) -> LoadedModel:
    """Load weights, build the decoder on ``device`` in ``dtype`` (then quantize), and load the tokenizer.

    ``quantization`` auto: see ``resolve_quantization`` (the GGUF's own blocks where they are Q4_1 / Q8_0)."""
    path = checkpoint_path(model_path)
    file = None if os.path.isdir(path) else GGUFFile(path)
    quantization, reason = resolve_quantization(quantization, device, None if file is None else file.matrix_types())
    if quantization == "q4_1" and file is not None:
        model = _load_gguf_blocks(file, device, dtype, attention_backend)
    else:
        config, weights = (file.config, file.tensors()) if file is not None else load_hf_folder(path)
        model = LlamaForCausalLM(config, device=device, dtype=dtype, attention_backend=attention_backend)
        model.load_weights(weights)
        del weights  # the float32 checkpoint: free it before quantizing makes more copies
        model.quantize(quantization)
    model.eval()
    return LoadedModel(path, model.config, model, Tokenizer.from_model_path(path), reason)


def _load_gguf_blocks(
    file: GGUFFile, device: torch.device, dtype: torch.dtype, attention_backend: str
) -> LlamaForCausalLM:
    """q4_1 on a GGUF: the file's own Q4_1 / Q8_0 blocks are kept as they are (lossless) and never
    dequantized; only the other tensors (norms, matrices the blocks cannot stand for) are read as floats."""
    config = file.config
    blocks = usable_blocks(file.blocks(), config.num_layers)
    model = LlamaForCausalLM(config, device=device, dtype=dtype, attention_backend=attention_backend)
    model.load_blocks(file.tensors(skip=blocks.keys()), blocks)
    return model
