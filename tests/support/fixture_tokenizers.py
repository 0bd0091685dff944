"""The tiny fixtures' tokenizers (committed under tests/fixtures/tokenizers/), made by make_gguf_fixtures.py.

- ``bpe-smollm``: SmolLM2's byte-level BPE (from the embedded GGUF) cut to its first 1024 tokens: the 17
  special tokens, the 256 bytes and the first 751 merges. Any text still encodes; the pre-tokenizer is
  SmolLM2's, which llama.cpp's converter calls "smollm" (``smollm_pre_check`` asks it).
- ``spm-llama`` / ``spm-gemma``: SentencePiece BPE models with byte fallback, trained with the
  ``sentencepiece`` package on ``corpus.txt`` (an extract of this repository's docs plus a few
  multilingual, code and emoji lines), in
  the layout of Llama 2 / Mistral v0.1 / Phi-3 (``<unk> <s> </s>``, a dummy prefix) and of Gemma
  (``<pad> <eos> <bos> <unk> <mask>``, no dummy prefix, ``<start_of_turn>`` / ``<end_of_turn>``).

Only the script imports this module (it needs ``sentencepiece``, which the project does not).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.archs import TOKENIZER_IDS, TOKENIZERS_DIR

# The SentencePiece training text, committed so the models are reproducible: README.md and three docs pages
# as of issue 29 (commit 8fe031b), then a few multilingual, code and emoji lines.
CORPUS = TOKENIZERS_DIR / "corpus.txt"
SPM_STYLES: dict[str, dict[str, Any]] = {
    "spm-llama": dict(
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        add_dummy_prefix=True,
        user_defined_symbols=[],
        hf_class="LlamaTokenizer",
    ),
    "spm-gemma": dict(
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        add_dummy_prefix=False,
        user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
        hf_class="GemmaTokenizer",
    ),
}
CHAT_TEMPLATES = {
    "spm-llama": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    ),
    "spm-gemma": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}


def save_full_smollm(folder: Path) -> Path:
    """SmolLM2's whole tokenizer, as radixserve builds it from the embedded GGUF, saved as an HF folder."""
    from radixserve.model.gguf_loader import default_model_path
    from radixserve.model.tokenizer import Tokenizer

    if not (folder / "tokenizer.json").is_file():
        Tokenizer.from_gguf(default_model_path()).hf.save_pretrained(folder)
    return folder


def smollm_pre_check(llama_cpp: Path, full_folder: Path) -> str:
    """The converter's own name for SmolLM2's full tokenizer's pre-tokenizer (expected: "smollm")."""
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']\n"
        "from conversion.base import TextModel\nfrom transformers import AutoTokenizer\n"
        "print(TextModel.get_vocab_base_pre(None, AutoTokenizer.from_pretrained(sys.argv[2])))"
    )
    folder = save_full_smollm(full_folder)
    out = subprocess.run([sys.executable, "-c", code, str(llama_cpp), str(folder)], capture_output=True, text=True)
    pre = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    if pre != "smollm":
        raise RuntimeError(f"llama.cpp's converter does not call SmolLM2's tokenizer 'smollm': {out.stderr[-2000:]}")
    return pre


def cut_bpe(full_folder: Path, size: int) -> Any:
    """The full BPE tokenizer keeping ids below ``size`` and the merges among them, as a transformers tokenizer."""
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    full = AutoTokenizer.from_pretrained(full_folder)
    spec = json.loads(full.backend_tokenizer.to_str())
    vocab = {tok: i for tok, i in spec["model"]["vocab"].items() if i < size}
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if {m[0], m[1], m[0] + m[1]} <= vocab.keys()]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=RustTokenizer.from_str(json.dumps(spec)),
        chat_template=full.chat_template,
        **{name: getattr(full, name) for name in names},
    )


def train_spm(style: str, vocab_size: int) -> bytes:
    """A SentencePiece BPE model (``tokenizer.model`` bytes) in the given style's layout."""
    import sentencepiece as spm  # type: ignore[import-not-found]  # only in the script's venv

    options = {k: v for k, v in SPM_STYLES[style].items() if k != "hf_class"}
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.read_text(encoding="utf-8").splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
        **options,
    )
    return model.getvalue()


def save_spm(style: str, folder: Path) -> None:
    """Train ``style``'s SentencePiece model into ``folder`` and save transformers' tokenizer for it beside."""
    import transformers

    shutil.rmtree(folder, ignore_errors=True)  # else from_pretrained reads the old tokenizer.json
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(train_spm(style, TOKENIZER_IDS[style]["vocab_size"]))
    hf_class = getattr(transformers, SPM_STYLES[style]["hf_class"])
    tok = hf_class.from_pretrained(folder, add_bos_token=True)  # as Llama 2, Mistral and Gemma do
    tok.chat_template = CHAT_TEMPLATES[style]
    tok.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for machine_specific in ("vocab_file", "is_local", "local_files_only"):
        config.pop(machine_specific, None)
    # As real checkpoints' configs list them (transformers 5 no longer writes it): llama.cpp's converter
    # types a SentencePiece piece CONTROL only when this says it is special.
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip}
        | {"single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.added_tokens_decoder.items())
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def make_tokenizers(full_folder: Path) -> None:
    """Re-make every committed tokenizer folder under tests/fixtures/tokenizers/."""
    bpe = cut_bpe(save_full_smollm(full_folder), TOKENIZER_IDS["bpe-smollm"]["vocab_size"])
    shutil.rmtree(TOKENIZERS_DIR / "bpe-smollm", ignore_errors=True)
    bpe.save_pretrained(TOKENIZERS_DIR / "bpe-smollm")
    for style in SPM_STYLES:
        save_spm(style, TOKENIZERS_DIR / style)
