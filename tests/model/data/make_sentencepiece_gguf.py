"""Make sentencepiece.gguf and sentencepiece_reference.json: a real SentencePiece BPE model, as
llama.cpp's converter writes it, and what SentencePiece itself encodes the test corpus to.

Not run by the tests (they read the committed files). Needs the ``sentencepiece`` package, which is
no dependency of the project; from the repository root, with it in a throwaway venv:

    python -m venv /tmp/spvenv && /tmp/spvenv/bin/pip install sentencepiece
    PYTHONPATH=$PWD:/tmp/spvenv/lib/python3.11/site-packages python tests/model/data/make_sentencepiece_gguf.py

The model is trained on the shared test corpus as Llama 2's was set up: BPE, byte fallback (a
character outside the vocabulary becomes its UTF-8 bytes), digits split, a dummy "▁" prefix, no
whitespace normalisation. The GGUF's token list, scores and types are written as
``_create_vocab_sentencepiece`` in llama.cpp's convert_hf_to_gguf.py reads them from the model.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import sentencepiece as spm

from tests.model.test_tokenizer_gguf import CORPUS

HERE = Path(__file__).resolve().parent
# SentencePieceTokenTypes in llama.cpp's converter
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6
EXTRA_TEXTS = [
    " leading space",
    "   three leading spaces",
    "trailing  ",
    "[INST] hi [/INST]",
    "rare: 鼹鼠 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
]


def train() -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in CORPUS if line.strip()] * 20),
        model_writer=model,
        model_type="bpe",
        vocab_size=600,
        hard_vocab_limit=False,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        character_coverage=0.99,  # the rarest characters fall back to bytes
        control_symbols=["[INST]", "[/INST]"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def token_type(sp: spm.SentencePieceProcessor, token_id: int) -> int:
    for check, kind in ((sp.IsUnknown, UNKNOWN), (sp.IsControl, CONTROL), (sp.IsUnused, UNUSED), (sp.IsByte, BYTE)):
        if check(token_id):
            return kind
    return NORMAL


def write_gguf(sp: spm.SentencePieceProcessor, path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    ids = range(sp.GetPieceSize())
    writer.add_token_list([sp.IdToPiece(i) for i in ids])
    writer.add_token_scores([sp.GetScore(i) for i in ids])
    writer.add_token_types([token_type(sp, i) for i in ids])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)  # as a Llama 2 / Mistral v0.1 tokenizer_config.json says
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    sp = train()
    write_gguf(sp, HERE / "sentencepiece.gguf")
    texts = [*CORPUS, *EXTRA_TEXTS]
    reference = [{"text": text, "ids": sp.Encode(text), "decoded": sp.Decode(sp.Encode(text))} for text in texts]
    for entry in reference:  # see test_tokenizer_sentencepiece.py: transformers drops one "▁" before a leading space
        if entry["text"].startswith(" "):
            entry["ids_after_first_space"] = sp.Encode(entry["text"][1:])
    (HERE / "sentencepiece_reference.json").write_text(json.dumps(reference, ensure_ascii=False, indent=0) + "\n")
    print(f"{sp.GetPieceSize()} pieces, {len(reference)} reference texts")


if __name__ == "__main__":
    main()
