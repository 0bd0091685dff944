"""Our GGUF tokenizers against llama.cpp itself: the ids llama.cpp (llama-cpp-python 0.3.36) gave for
the shared corpus, recorded by tests/model/data/make_llamacpp_reference.py, for SmolLM2's vocabulary
under every ``tokenizer.ggml.pre`` we build and for the SentencePiece fixture.

transformers' GGUF conversion stays the reference (test_tokenizer_gguf.py checks that we equal it);
this file pins where llama.cpp agrees with both, and exactly where it does not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import pre_tokenizers

from radixserve.model.gguf_loader import GGUFReader, default_model_path
from radixserve.model.gguf_tokenizer import PRE_TOKENIZER_SPLITS
from radixserve.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data"


def write_smollm2_vocab_gguf(path: Path, pre: str, reader: gguf.GGUFReader | None = None) -> Path:
    """The embedded SmolLM2's metadata (vocabulary, merges, special tokens, no tensors) under another pre."""
    reader = reader or GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        value = pre if name == "tokenizer.ggml.pre" else field.contents()
        writer.add_key_value(name, value, field.types[0], sub_type=field.types[1] if len(field.types) > 1 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / "llamacpp_reference.json").read_text(encoding="utf-8"))
    return out


@pytest.fixture(scope="module")
def smollm2_under(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """pre -> our tokenizer of SmolLM2's vocabulary under that pre."""
    reader, folder = GGUFReader(default_model_path()), tmp_path_factory.mktemp("pre")
    return lambda pre: Tokenizer.from_gguf(write_smollm2_vocab_gguf(folder / f"{pre}.gguf", pre, reader))


def _encodes(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tok.encode(text, add_special_tokens=False) for text in texts]


def test_the_reference_covers_every_pre_we_build(reference: dict[str, Any]) -> None:
    assert sorted(reference["smollm2_vocab"]) == sorted(PRE_TOKENIZER_SPLITS)


@pytest.mark.slow
@pytest.mark.parametrize("pre", sorted(set(PRE_TOKENIZER_SPLITS) - {"default", "smollm"}))
def test_byte_level_pre_tokenizers_equal_llamacpp(reference: dict[str, Any], smollm2_under: Any, pre: str) -> None:
    """llama-bpe, qwen2, tekken, gpt-4o, gpt-2, ...: llama.cpp's ids, text for text."""
    assert _encodes(smollm2_under(pre), reference["texts"]) == reference["smollm2_vocab"][pre]


def test_smollm_differs_from_llamacpp_only_by_its_digit_split(reference: dict[str, Any]) -> None:
    """llama.cpp (like SmolLM2's own tokenizer.json) splits every digit apart before GPT-2's regex;
    transformers' GGUF conversion does not, and we follow it (the embedded model's behaviour is pinned).
    Texts without a digit agree; with a Digits step in front, every text does (before a digit
    llama.cpp keeps a run of spaces whole: "a  1" is "a" "ĠĠ" "1" there, "a" "Ġ" "Ġ" "1" here; also
    "½" and Arabic-Indic digits)."""
    ours, texts, expected = Tokenizer.from_model_path(None), reference["texts"], reference["smollm2_vocab"]["smollm"]
    differ = [text for text, ids in zip(texts, expected) if ours.encode(text, add_special_tokens=False) != ids]
    assert differ and all(re.search(r"\d|½", text) for text in differ)
    ours.hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert _encodes(ours, texts) == expected


@pytest.mark.slow
def test_default_pre_is_gpt2s_rules_not_llamacpps(reference: dict[str, Any], smollm2_under: Any) -> None:
    """A file from before llama.cpp named pre-tokenizers: transformers (and we) apply GPT-2's regex,
    llama.cpp its own "default" splits; ours equal llama.cpp's ids under "gpt-2"."""
    ours = _encodes(smollm2_under("default"), reference["texts"])
    assert ours == reference["smollm2_vocab"]["gpt-2"] != reference["smollm2_vocab"]["default"]


def test_sentencepiece_equals_llamacpp_but_for_a_leading_space(reference: dict[str, Any]) -> None:
    """llama.cpp prepends its "▁" to a text that starts with a space too (as SentencePiece does);
    transformers' Metaspace(prepend_scheme="first") does not, and we follow transformers."""
    ours = Tokenizer.from_gguf(DATA / "sentencepiece.gguf")
    for text, ids in zip(reference["texts"], reference["sentencepiece"]):
        mine = ours.encode(text, add_special_tokens=False)
        if text.startswith(" "):
            assert mine != ids and ours.hf.convert_ids_to_tokens(ids)[0].startswith("▁"), text
        else:
            assert mine == ids, text
