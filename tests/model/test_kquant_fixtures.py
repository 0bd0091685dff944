"""The K-quant fixtures (manifest ``quantized``): llama-quantize output of a tiny llama whose K are multiples of 256.

Each file is what the manifest says (type, tensor types), every K-quant type appears in some file, and
each still holds the HF model make_gguf_fixtures.py quantized (within the type's error: the staleness
check, as the f16 fixtures' is transformers reading them back).
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from benchmarks.quant_formats import file_tensors
from radixserve.model.gguf_loader import GGUFFile
from tests.support.archs import GGUF_DIR, build_arch_model, gguf_path

QUANTIZED: dict[str, dict[str, object]] = json.loads((GGUF_DIR / "manifest.json").read_text())["quantized"]
# |dequantized - float| / |float| over a whole matrix: measured 0.072 (Q4_K), 0.036 (Q5_K), 0.018 (Q6_K) on these
# random N(0, 0.1) weights, about half of each bound; another seed's weights are ~1.41 away.
RELATIVE_ERROR = {"Q4_K": 0.15, "Q5_K": 0.08, "Q6_K": 0.04}


def llama_quantize_type(name: str) -> str:
    """The TYPE argument the fixture was made with (``Q4_K_M``), from its manifest entry's command."""
    made = str(QUANTIZED[name]["made"])
    return made.rsplit("`", 2)[1].split()[-2]


def test_every_k_quant_type_is_in_some_fixture() -> None:
    held = set().union(*(file_tensors(gguf_path(name)).types for name in QUANTIZED))
    assert {"Q4_K", "Q5_K", "Q6_K"} <= held


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_each_fixture_is_what_its_manifest_says(name: str) -> None:
    path = gguf_path(name)
    assert file_tensors(path).types == QUANTIZED[name]["tensor_types"]
    file_type = gguf.GGUFReader(path).get_field("general.file_type")
    assert file_type is not None
    assert gguf.LlamaFileType(file_type.contents()).name == f"MOSTLY_{llama_quantize_type(name)}"
    assert path.stat().st_size < 2**20


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_each_fixture_holds_its_hf_model(name: str) -> None:
    entry = QUANTIZED[name]
    file = GGUFFile(gguf_path(name))
    model = build_arch_model(str(entry["base"]), int(str(entry["seed"])), **entry["shape"])  # type: ignore[arg-type]
    params, tensors = dict(model.named_parameters()), file.tensors()
    with torch.no_grad():
        for hf_name, kind in file.matrix_types().items():
            weight = params[hf_name]
            error = (tensors[hf_name] - weight).norm() / weight.norm()
            assert error <= RELATIVE_ERROR[kind], f"{hf_name} ({kind}): relative error {error:.3f}"
        norms = [hf_name for hf_name, tensor in tensors.items() if tensor.dim() == 1]
        assert norms and all(torch.equal(tensors[n], params[n]) for n in norms)  # float32 in the file: exact
