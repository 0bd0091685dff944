"""load_model: a path (HF folder or .gguf file, or None for the embedded default) -> ready model.

No hub access ever: weights and tokenizer come from local files only.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import psutil
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.gguf_loader import GGUFFile, Kept, default_model_path
from radixserve.model.hf_loader import load_hf_folder
from radixserve.model.kept_weights import usable_blocks
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.precision import resolve_quantization
from radixserve.model.quant import BLOCK_QUANTIZATIONS
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# auto refuses to dequantize matrices it cannot keep when their float copy would take more than this share of
# the memory available (the KV pool is allocated next): a clear error instead of swapping or the OOM killer.
FLOAT_COPY_MAX_SHARE = 0.8


@dataclass(frozen=True)
class LoadedModel:
    path: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    quantization_reason: str  # why the model has its quantization (what auto chose, and why)
    file_tensor_bytes: int | None = None  # a GGUF's tensor bytes (what its weights take as stored); None: HF


@dataclass(frozen=True)
class Checkpoint:
    """What a load reads from the files: float weights, the file's own weights that replace the others (q4_1),
    and the tokenizer (a GGUF's from the same parse of the file)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    blocks: dict[str, Kept]
    quantization: str  # resolved: none | int8 | q4_1 | q4_1-exact
    reason: str
    tokenizer: Tokenizer
    file_types: dict[str, str] | None = None  # a GGUF's matrices: HF name -> storage type
    float_rest: bool = False  # auto: matrices not kept stay float (never re-quantized)
    file_tensor_bytes: int | None = None


def checkpoint_path(model_path: str | None) -> str:
    """``model_path`` (None: the embedded default) checked to be an HF folder or a .gguf file."""
    path = model_path or default_model_path()
    if os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path)):
        return path
    raise FileNotFoundError(f"model_path {path!r} is neither an HF folder nor a .gguf file")


def read_checkpoint(
    path: str, device: torch.device, quantization: str = "none", dtype: torch.dtype = torch.float32
) -> Checkpoint:
    """Resolve ``quantization`` (auto: ``resolve_quantization``) and read what it needs: under q4_1 a
    GGUF's own matrices of every kept type as they are (``GGUFFile.blocks``), and only the other tensors
    (norms, matrices of other types) dequantized; auto checks their float copy (in ``dtype``) fits first."""
    if os.path.isdir(path):
        method, reason = resolve_quantization(quantization, device, None)
        return Checkpoint(*load_hf_folder(path), {}, method, reason, Tokenizer.from_model_path(path))
    file = GGUFFile(path)
    method, reason = resolve_quantization(quantization, device, file.matrix_types())
    float_rest = quantization == "auto"  # auto loses nothing: what it cannot keep is dequantized, not re-quantized
    blocks = usable_blocks(file.blocks(), file.config.num_layers) if method in BLOCK_QUANTIZATIONS else {}
    if float_rest and device.type == "cpu":
        check_float_copy(file, blocks.keys(), dtype)
    tokenizer = Tokenizer.from_model_path(path, gguf_reader=file.reader)  # the vocabulary is parsed already
    weights = file.tensors(skip=blocks.keys())
    return Checkpoint(
        file.config, weights, blocks, method, reason, tokenizer, file.weight_types(), float_rest, file.tensor_bytes()
    )


def check_float_copy(file: GGUFFile, kept: Collection[str], dtype: torch.dtype) -> None:
    """The matrices ``kept`` leaves out are dequantized to ``dtype``: log a warning naming their types, or raise
    ValueError when that copy (float32 as read, then the model's) would not fit in the memory available."""
    converted = {name: qtype for name, qtype in file.weight_types().items() if name not in kept}
    if not converted:
        return
    listing = ", ".join(f"{count} {qtype}" for qtype, count in sorted(Counter(converted.values()).items()))
    size = 4 + torch.empty((), dtype=dtype).element_size()
    need = size * sum(int(file.infos[name].n_elements) for name in converted)
    available = psutil.virtual_memory().available
    if need > FLOAT_COPY_MAX_SHARE * available:
        raise ValueError(
            f"cannot dequantize the GGUF's matrices stored as {listing} (not kept as stored: see the quantization "
            f"reason): their float copy needs {need / 2**30:.2f} GiB, over {FLOAT_COPY_MAX_SHARE:.0%} of the "
            f"{available / 2**30:.2f} GiB available; free memory, or use a file of a kept type"
        )
    logger.warning(
        "quantization auto: the GGUF's matrices stored as %s are not kept as stored: dequantized to %s, "
        "%.1f MiB to load",
        listing,
        str(dtype).removeprefix("torch."),
        need / 2**20,
    )


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
    checkpoint = read_checkpoint(path, device, quantization, dtype)
    config, method, reason = checkpoint.config, checkpoint.quantization, checkpoint.reason
    tokenizer, types, float_rest = checkpoint.tokenizer, checkpoint.file_types, checkpoint.float_rest
    file_bytes = checkpoint.file_tensor_bytes
    model = LlamaForCausalLM(config, device=device, dtype=dtype, attention_backend=attention_backend)
    if checkpoint.blocks:
        model.load_blocks(checkpoint.weights, checkpoint.blocks, method, types, float_rest)
    else:
        model.load_weights(checkpoint.weights)
        del checkpoint  # the float32 checkpoint: free it before quantizing makes more copies
        model.quantize(method, {}, types, float_rest)
    model.eval()
    return LoadedModel(path, config, model, tokenizer, reason, file_bytes)
