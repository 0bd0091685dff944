"""A GGUF copied with gguf-py: its matrices re-stored as another type (Q8_0, Q5_0, Q4_K, ...), or metadata added.

Not a converter: the tensors and metadata stay what llama.cpp's converter wrote (the committed fixtures
in tests/fixtures/gguf/). ``matrix_type`` quantizes every 2-D float tensor with ``gguf.quants`` (as
``llama-quantize --pure`` with that type would; 1-D norms, biases and rope factors stay as they are) and
sets general.file_type to match; K-quant types come from tests/support/kquants.py and fall back as
llama.cpp's do where a row is not whole 256-value blocks. ``types`` re-stores the named tensors (GGUF names) as
their own types instead, as llama-quantize mixes types in one file. ``add`` appends keys (a list value is written
as an array). ``requantize_gguf`` is ``llama-quantize --allow-requantize`` with a preset's per-tensor mix.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.support import kquants

FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
QType = gguf.GGMLQuantizationType
# llama.cpp's tensor_type_fallback for a row that is not whole 256-value blocks.
K_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}
# The presets requantize_gguf mirrors: ftype name -> llama_ftype_get_default_type.
PRESET_DEFAULT = {
    "Q4_0": QType.Q4_0,
    "Q4_1": QType.Q4_1,
    "Q5_0": QType.Q5_0,
    "Q5_1": QType.Q5_1,
    "Q8_0": QType.Q8_0,
    "Q4_K_M": QType.Q4_K,
    "Q5_K_M": QType.Q5_K,
    "Q6_K": QType.Q6_K,
}
_FILE_TYPE_ALIAS = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # llama-quantize's own aliases


def rewrite_gguf(
    src: Path,
    dst: Path,
    matrix_type: str | None = None,
    add: dict[str, Any] | None = None,
    types: Mapping[str, str] | None = None,
) -> Path:
    """``src`` written to ``dst`` with its matrices as ``matrix_type`` (None: unchanged), the matrices named in
    ``types`` as their own type, and the keys ``add``."""
    reader = gguf.GGUFReader(src)
    stored: dict[str, QType] = {}
    for tensor in reader.tensors:
        target = (types or {}).get(tensor.name, matrix_type)
        if target is not None and len(tensor.shape) == 2 and tensor.tensor_type in FLOAT_TYPES:
            stored[tensor.name] = fallback_type(QType[target], int(tensor.shape[0]))
    file_type = _FILE_TYPE_ALIAS.get(matrix_type, matrix_type) if matrix_type else None
    return _write(reader, dst, file_type, stored, add)


def requantize_gguf(src: Path, dst: Path, preset: str, drop: Collection[str] = ()) -> Path:
    """``llama-quantize --allow-requantize src dst preset`` without an imatrix: each matrix dequantized to float32
    and stored as the type ``preset_tensor_types`` gives it; one already of that type is copied, as llama does.
    ``drop``: keys left out (e.g. the vocabulary, for a file whose tokenizer no test reads)."""
    reader = gguf.GGUFReader(src)
    return _write(reader, dst, preset, preset_tensor_types(reader, preset), None, drop)


def fallback_type(qtype: QType, row_len: int) -> QType:
    """llama.cpp's tensor_type_fallback: a K-quant on rows that are not whole 256-value blocks becomes its
    32-block stand-in (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0); F16 where even that does not fit."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if row_len % block_size == 0:
        return qtype
    qtype = K_FALLBACK.get(qtype, qtype)
    return qtype if row_len % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else QType.F16


def preset_tensor_types(reader: gguf.GGUFReader, preset: str) -> dict[str, QType]:
    """The type llama-quantize's ``preset`` (a PRESET_DEFAULT key) stores each quantizable tensor as.

    Mirrors llama-quant.cpp's llama_tensor_get_type for these presets, without an imatrix: tensors walked
    in its order (by layer, then name); the output matrix, or a tied token embedding, Q6_K unless its rows
    are not whole blocks of the preset's type (then Q8_0) or the preset is Q8_0; attn_v / attn_qkv and
    ffn_down Q6_K in the layers ``use_more_bits`` picks under Q4_K_M / Q5_K_M; then the shape fallback.
    Simplified away: the MoE, Falcon, 70B and imatrix rules, --pure, --tensor-type and the output/embedding
    type options, and its list of names never quantized beyond norms (only llama-family names here).
    """
    default = PRESET_DEFAULT[preset]
    tied = all(t.name != "output.weight" for t in reader.tensors)
    n_attn_v = sum(_category(t.name) == "attn_v" for t in reader.tensors)
    n_layer = int(_field(reader, f"{_field(reader, 'general.architecture')}.block_count"))
    counters = {"attn_v": 0, "ffn_down": 0}
    types = {}
    for tensor in sorted(reader.tensors, key=lambda t: (_layer(t.name), t.name)):
        if len(tensor.shape) < 2 or not tensor.name.endswith("weight") or "_norm.weight" in tensor.name:
            continue
        category, qtype, row_len = _category(tensor.name), default, int(tensor.shape[0])
        if category == "output" or (tied and category == "token_embd"):
            if row_len % gguf.GGML_QUANT_SIZES[qtype][0]:
                qtype = QType.Q8_0
            elif qtype != QType.Q8_0:
                qtype = QType.Q6_K
        elif category in counters:
            total = n_attn_v if category == "attn_v" else n_layer
            if preset in ("Q4_K_M", "Q5_K_M") and _use_more_bits(counters[category], total):
                qtype = QType.Q6_K
            counters[category] += 1
        types[tensor.name] = fallback_type(qtype, row_len)
    return types


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of the layers that get more bits: the first and last eighth, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _category(name: str) -> str:
    """llama-quant.cpp's tensor_get_category, reduced to the categories these presets treat apart."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    if any(part in name for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")):
        return "attn_v"
    return "ffn_down" if "ffn_down" in name else "other"


def _layer(name: str) -> int:
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"the GGUF has no {key}"
    return field.contents()


def _write(
    reader: gguf.GGUFReader,
    dst: Path,
    file_type: str | None,
    types: dict[str, QType],
    add: dict[str, Any] | None,
    drop: Collection[str] = (),
) -> Path:
    """``reader``'s keys (general.file_type set to ``file_type`` when given) and ``add``, and its tensors, each
    re-stored as ``types[name]`` (dequantized to float32 first) where that differs from its own type."""
    writer = gguf.GGUFWriter(str(dst), str(_field(reader, "general.architecture")))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in drop:
            continue
        if field.name == "general.file_type" and file_type is not None:
            writer.add_file_type(_file_type(file_type))
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for key, value in (add or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for tensor in reader.tensors:
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        target = types.get(tensor.name, kind)
        if target != kind:
            data, kind = kquants.quantize(gguf.quants.dequantize(data, kind), target), target
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _file_type(matrix_type: str) -> gguf.LlamaFileType:
    """general.file_type of a file whose matrices are ``matrix_type`` (GUESSED where llama.cpp names none)."""
    if matrix_type == "F32":
        return gguf.LlamaFileType.ALL_F32
    return gguf.LlamaFileType.__members__.get(f"MOSTLY_{matrix_type}", gguf.LlamaFileType.GUESSED)
