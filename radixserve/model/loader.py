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
from radixserve.model.quant import BLOCK_QUANTIZATIONS
from radixserve.model.quant_blocks import QuantBlocks
from radixserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    path: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    quantization_reason: str  # why the model has its quantization (what auto chose, and why)


@dataclass(frozen=True)
class Checkpoint:
    """What a load reads from the files: float weights, the blocks that replace the others (q4_1),
    and the tokenizer (a GGUF's from the same parse of the file)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    blocks: dict[str, QuantBlocks]
    quantization: str  # resolved: none | int8 | q4_1 | q4_1-exact
    reason: str
    tokenizer: Tokenizer


def checkpoint_path(model_path: str | None) -> str:
    """``model_path`` (None: the embedded default) checked to be an HF folder or a .gguf file."""
    path = model_path or default_model_path()
    if os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path)):
        return path
    raise FileNotFoundError(f"model_path {path!r} is neither an HF folder nor a .gguf file")


def read_checkpoint(path: str, device: torch.device, quantization: str = "none") -> Checkpoint:
    """Resolve ``quantization`` (auto: ``resolve_quantization``) and read what it needs: under q4_1 a
    GGUF's own Q4_0 / Q4_1 / Q8_0 blocks as they are, and only the other tensors (norms,
    matrices the blocks cannot stand for) dequantized."""
    if os.path.isdir(path):
        method, reason = resolve_quantization(quantization, device, None)
        return Checkpoint(*load_hf_folder(path), {}, method, reason, Tokenizer.from_model_path(path))
    file = GGUFFile(path)
    method, reason = resolve_quantization(quantization, device, file.matrix_types())
    blocks = usable_blocks(file.blocks(), file.config.num_layers) if method in BLOCK_QUANTIZATIONS else {}
    tokenizer = Tokenizer.from_model_path(path, gguf_reader=file.reader)  # the vocabulary is parsed already
    return Checkpoint(file.config, file.tensors(skip=blocks.keys()), blocks, method, reason, tokenizer)


def load_model(
    model_path: str | None,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str = "auto",
    quantization: str = "auto",
) -> LoadedModel:
    """Load weights, build the decoder on ``device`` in ``dtype`` (then quantize), and load the tokenizer."""
    path = checkpoint_path(model_path)
    # The GGUF reader (its map and ~300k metadata views of SmolLM2's vocabulary) is gone by now.
    checkpoint = read_checkpoint(path, device, quantization)
    config, method, reason = checkpoint.config, checkpoint.quantization, checkpoint.reason
    tokenizer = checkpoint.tokenizer
    model = LlamaForCausalLM(config, device=device, dtype=dtype, attention_backend=attention_backend)
    if checkpoint.blocks:
        model.load_blocks(checkpoint.weights, checkpoint.blocks, method)
    else:
        model.load_weights(checkpoint.weights)
        del checkpoint  # the float32 checkpoint: free it before quantizing makes more copies
        model.quantize(method)
    model.eval()
    return LoadedModel(path, config, model, tokenizer, reason)
