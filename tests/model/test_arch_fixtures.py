"""The tiny per-architecture fixtures (tests/support/archs.py, tests/fixtures/gguf/) and radixserve against them.

First the fixtures themselves: the committed GGUFs are the ones the manifest lists, each names its
architecture, transformers reads each back to exactly its HF folder's logits, and each HF model really
uses the feature it stands for (switching it off moves the logits). Then radixserve: its float32
logits and greedy tokens equal transformers' on a prompt longer than the sliding window, from the GGUF
and from the HF folder, on the reference and the default attention backends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from radixserve.model.tokenizer import Tokenizer
from tests.model.test_llama import greedy, prefill
from tests.model.tiny import load_ours
from tests.support.archs import GGUF_DIR, SPECS, TOKENIZERS_DIR, build_arch_model, gguf_path
from tests.support.fidelity import fixture_prompt, reference_greedy, reference_logits

NAMES = list(SPECS)
PROMPT_LEN = 40  # > the sliding window (8) of mistral / gemma2 / gemma3
BACKENDS = ("reference", "auto")
MANIFEST = json.loads((GGUF_DIR / "manifest.json").read_text())
# HF settings that switch a fixture's feature off: its logits must move far more than the 1e-3 tolerance.
ABLATIONS: dict[str, dict[str, Any]] = {
    "llama3 rope scaling": {"name": "llama3", "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "mistral sliding window": {"name": "mistral", "sliding_window": None},
    "gemma2 sliding window": {"name": "gemma2", "sliding_window": 4096},
    "gemma2 attention soft-cap": {"name": "gemma2", "attn_logit_softcapping": None},
    "gemma2 final soft-cap": {"name": "gemma2", "final_logit_softcapping": None},
    "phi3 sliding window": {"name": "phi3", "sliding_window": 4096},
    "gemma3 sliding window": {"name": "gemma3", "sliding_window": 4096},
    "gemma3 linear rope scaling": {
        "name": "gemma3",
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "gemma3 local rope base": {
        "name": "gemma3",
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    },
}


def assert_matches_reference(path: Path, backend: str) -> None:
    ids = fixture_prompt(PROMPT_LEN)
    ours = load_ours(path, backend=backend)
    with torch.no_grad():
        error = (prefill(ours, ids) - reference_logits(path, ids)).abs().max().item()
        assert error <= 1e-3, f"max |logit error| {error:.2e}"
        assert greedy(ours, ids, 12) == reference_greedy(path, ids, 12)


# ---- the fixtures themselves ------------------------------------------------------------------------


def test_manifest_lists_every_committed_gguf_byte_for_byte() -> None:
    listed = {**MANIFEST["fixtures"], **MANIFEST["quantized"]}  # quantized: tests/model/test_kquant_fixtures.py
    assert sorted(MANIFEST["fixtures"]) == sorted(NAMES)
    assert sorted(p.stem for p in GGUF_DIR.glob("*.gguf")) == sorted(listed)
    for name, entry in listed.items():
        data = gguf_path(name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"]), name
    assert sum(entry["bytes"] for entry in listed.values()) < 15 * 2**20


@pytest.mark.parametrize("name", NAMES)
def test_each_gguf_names_its_architecture_and_tokenizer(name: str) -> None:
    reader = gguf.GGUFReader(gguf_path(name))
    spec = SPECS[name]

    def field(key: str) -> object:
        found = reader.get_field(key)
        assert found is not None, f"{name}.gguf lacks {key}"
        return found.contents()

    assert field("general.architecture") == spec.gguf_arch
    assert field("general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    assert len(field("tokenizer.ggml.tokens")) == 1024  # type: ignore[arg-type]
    if spec.tokenizer == "bpe-smollm":
        assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("gpt2", "smollm")
    else:
        assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")) == ("llama", "default")
    if name in ("phi3", "gemma2", "gemma3"):
        assert field(f"{name}.attention.sliding_window") == 8
    assert reader.get_field("tokenizer.chat_template") is not None


@pytest.mark.parametrize("name", NAMES)
def test_transformers_reads_each_gguf_back_to_its_hf_folder(name: str, arch_folder: Callable[..., Path]) -> None:
    """Also the staleness check: a change to archs.py or to HF's init needs make_gguf_fixtures.py re-run."""
    ids = fixture_prompt(PROMPT_LEN)
    # what the converter drops (mistral's sliding window: the GGUF is the full-attention model)
    folder = arch_folder(name, **SPECS[name].gguf_overrides)
    expected = reference_logits(folder, ids)
    assert (reference_logits(gguf_path(name), ids) - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_each_fixture_exercises_its_feature(ablation: str) -> None:
    overrides = dict(ABLATIONS[ablation])
    name = str(overrides.pop("name"))
    ids = torch.tensor([fixture_prompt(PROMPT_LEN)])
    with torch.no_grad():
        with_feature = build_arch_model(name)(ids).logits[0]
        without = build_arch_model(name, **overrides)(ids).logits[0]
    assert (with_feature - without).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma2"])  # one per tokenizer: bpe-smollm, spm-llama, spm-gemma
def test_radixserve_tokenizes_each_kind_like_transformers_gguf_conversion(name: str) -> None:
    from transformers import AutoTokenizer

    text = "Hello wörld! 🚀 ✅ 3.14 12345 你好，世界 Привет\ndef f(x):\n    return x  <end_of_turn> tail"
    expected = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=f"{name}.gguf")(text).input_ids
    assert AutoTokenizer.from_pretrained(TOKENIZERS_DIR / SPECS[name].tokenizer)(text).input_ids == expected
    assert Tokenizer.from_gguf(gguf_path(name)).encode(text) == expected


# ---- radixserve against the reference -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_radixserve_gguf_logits_and_greedy_tokens_match_transformers(name: str, backend: str) -> None:
    assert_matches_reference(gguf_path(name), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_radixserve_hf_folder_logits_and_greedy_tokens_match_transformers(
    name: str, backend: str, arch_folder: Callable[..., Path]
) -> None:
    assert_matches_reference(arch_folder(name), backend)
