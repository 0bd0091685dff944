"""A GGUF copied with gguf-py: its matrices re-stored as another type (Q8_0, Q5_0, ...), or metadata added.

Not a converter: the tensors and metadata stay what llama.cpp's converter wrote (the committed fixtures
in tests/fixtures/gguf/). ``matrix_type`` quantizes every 2-D float tensor with ``gguf.quants`` (as
``llama-quantize`` with one pure type would; 1-D norms, biases and rope factors stay as they are) and
sets general.file_type to match; ``types`` re-stores the named tensors (GGUF names) as their own types instead,
as llama-quantize mixes types in one file; ``add`` appends keys (a list value is written as an array).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


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
    arch_field = reader.get_field("general.architecture")
    assert arch_field is not None, f"{src} names no architecture"
    writer = gguf.GGUFWriter(str(dst), str(arch_field.contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type" and matrix_type is not None:
            writer.add_file_type(_file_type(matrix_type))
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for key, value in (add or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for tensor in reader.tensors:
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        target = (types or {}).get(tensor.name, matrix_type)
        if target is not None and data.ndim == 2 and kind in FLOAT_TYPES:
            qtype = gguf.GGMLQuantizationType[target]
            data, kind = gguf.quants.quantize(gguf.quants.dequantize(data, kind), qtype), qtype
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
