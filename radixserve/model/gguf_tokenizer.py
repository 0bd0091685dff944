"""A transformers fast tokenizer built straight from a GGUF's tokenizer metadata with ``tokenizers``.

transformers builds it too (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``), but parses
the whole file twice with its own reader and builds the vocabulary through a Python tokenizer
class: 10-12 s of SmolLM2's start-up. The same metadata is already parsed by the reader the
weights come from (``gguf_loader.GGUFReader``); here it goes into the same ``tokenizers``
pipeline transformers builds, wrapped in ``PreTrainedTokenizerFast`` with the same special
tokens and flags. Tests compare encodes, decodes and the serialised pipeline with transformers'
own build, for every pre-tokenizer and layout below.

Two tokenizer models (``tokenizer.ggml.model``):
- ``gpt2``: byte-level BPE with the file's merges, split first by the regex of its
  ``tokenizer.ggml.pre`` (``PRE_TOKENIZER_SPLITS``: llama.cpp's pre-tokenizer names, each with the
  regex of the model's own ``tokenizer.json``, as transformers and llama.cpp use it);
- ``llama``: a SentencePiece vocabulary (``gguf_sentencepiece``): Llama 2, Mistral v0.1, Gemma, Phi-3.
Anything else is ``UnsupportedGGUFTokenizer`` naming what is supported: never a guess.
"""

from __future__ import annotations

import functools
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from radixserve.model.gguf_sentencepiece import GEMMA_ARCHITECTURES, sentencepiece_backend, sentencepiece_layout

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Nemo ("tekken") and GPT-4o-style vocabularies ("gpt-4o", Llama 4): a word splits
# where lower case turns to upper case; GPT-4o's keeps a contraction on the word before it.
_WORD_START, _UPPER, _LOWER = r"[^\r\n\p{L}\p{N}]?", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN_SPLIT = rf"{_WORD_START}{_UPPER}*{_LOWER}+|{_WORD_START}{_UPPER}+{_LOWER}*|\p{{N}}{_REST}"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"{_WORD_START}{_UPPER}*{_LOWER}+{_CONTRACTION}|{_WORD_START}{_UPPER}+{_LOWER}*{_CONTRACTION}"
    rf"|\p{{N}}{{1,3}}{_REST}"
)
# tokenizer.ggml.pre -> the split regex before a byte-level step without its own regex; None: GPT-2's
# byte-level regex alone. The regexes are llama.cpp's (src/llama-vocab.cpp) in the spelling of the
# models' own tokenizer.json, which is transformers' spelling too ("(?i:'s|...)" for "'[sS]|...").
# Checked against llama.cpp's own ids too (tests/model/test_tokenizer_llamacpp.py): equal for every
# pre here but two, where we follow transformers, the reference:
# - "smollm": llama.cpp splits each digit apart first (as SmolLM2's own tokenizer.json does);
#   transformers does not. It shows where spaces run up to a digit ("a  1": llama.cpp "ĠĠ" "1",
#   here "Ġ" "Ġ" "1") and on digits outside ASCII ("½").
# - "default" (a file from before llama.cpp named pre-tokenizers): GPT-2's regex, as transformers;
#   llama.cpp adds a few extra splits there and warns that such a file should be regenerated.
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,  # Llama 3.x
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,  # Qwen2, Qwen2.5, Qwen3
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,  # Mistral Nemo and later
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
}
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


# Generation also ends on these when the file names them (llama.cpp's end-of-generation ids).
_STOP_IDS = ("eos_token_id", "eot_token_id", "eom_token_id")
# Special tokens a transformers class adds by default for an architecture (GemmaTokenizer's mask).
_CLASS_DEFAULTS: dict[str, dict[str, str]] = {arch: {"mask_token": "<mask>"} for arch in GEMMA_ARCHITECTURES}
_QWEN_ARCHITECTURES = ("qwen2", "qwen3")  # Qwen2Tokenizer adds its special tokens as added tokens


class UnsupportedGGUFTokenizer(ValueError):
    """This file's tokenizer is not one we build: the message names the supported ones."""


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: the spelling of every byte-level BPE token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [*printable, *range(256, 256 + len(others))]
    return {byte: chr(char) for byte, char in zip([*printable, *others], chars)}


def build_gguf_tokenizer(reader: gguf.GGUFReader) -> PreTrainedTokenizerFast:
    """The file's tokenizer as transformers would build it; UnsupportedGGUFTokenizer says why not."""
    meta = _metadata(reader)
    arch, model = str(meta.get("architecture")), meta.get("tokenizer_type")
    if model == "gpt2":
        backend = _byte_level_backend(meta)
    elif model == "llama":
        if meta.get("pre", "default") != "default" or "scores" not in meta:
            pre = meta.get("pre", "default")
            why = f"tokenizer.ggml.pre {pre!r}" if pre != "default" else "no tokenizer.ggml.scores"
            raise UnsupportedGGUFTokenizer(f"a SentencePiece vocabulary with {why} (supported: pre 'default', scores)")
        backend = sentencepiece_backend(arch, meta["tokens"], meta["scores"])
    else:
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.model {model!r} (supported: {', '.join(TOKENIZER_MODELS)})")
    tokens: list[str] = meta["tokens"]
    _add_file_tokens(backend, tokens, meta.get("token_type") or [], byte_level=model == "gpt2")
    # The keyword arguments transformers passes (get_gguf_tokenizer): flags only where the file has them;
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    config: dict[str, Any] = {k: meta[k] for k in ("chat_template", "add_bos_token", "add_eos_token") if k in meta}
    if model == "llama":
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_IDS.items():
        config[name] = tokens[meta[key]] if key in meta else None
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **_CLASS_DEFAULTS.get(arch, {}), **config)  # type: ignore[no-untyped-call]
    if arch in _QWEN_ARCHITECTURES:
        hf.add_tokens([AddedToken(token, special=True) for token in hf.all_special_tokens])
    return hf


def gguf_stop_token_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    """The ids the file says end a generation: eos, end-of-turn (``<|eot_id|>``), end-of-message."""
    meta = _metadata(reader, {f"tokenizer.ggml.{key}": key for key in _STOP_IDS})
    return tuple(dict.fromkeys(int(meta[key]) for key in _STOP_IDS if key in meta))


def gguf_tokenizer_kind(reader: gguf.GGUFReader) -> str:
    """What the file's tokenizer is, in words (for the start-up report)."""
    meta = _metadata(
        reader, {"tokenizer.ggml.model": "model", "tokenizer.ggml.pre": "pre", "general.architecture": "arch"}
    )
    if meta.get("model") == "llama":
        return f"SentencePiece BPE, {sentencepiece_layout(str(meta.get('arch')))} layout (GGUF)"
    return f"byte-level BPE, pre-tokenizer {meta.get('pre', 'default')!r} (GGUF)"


def _byte_level_backend(meta: dict[str, Any]) -> RustTokenizer:
    pre = meta.get("pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        supported = ", ".join(sorted(PRE_TOKENIZER_SPLITS))
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.pre {pre!r} is not one we know (supported: {supported})")
    pairs = [merge.split(" ") for merge in meta.get("merges", ())]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise UnsupportedGGUFTokenizer("a byte-level BPE vocabulary without merges, or with a malformed merge")
    return _byte_level_bpe(meta["tokens"], [(left, right) for left, right in pairs], PRE_TOKENIZER_SPLITS[pre])


def _metadata(reader: gguf.GGUFReader, keys: dict[str, str] | None = None) -> dict[str, Any]:
    """The tokenizer keys of the file (``keys``: file key -> our name; default all we build from)."""
    keys = keys or {
        "general.architecture": "architecture",
        "tokenizer.ggml.model": "tokenizer_type",
        "tokenizer.ggml.pre": "pre",
        "tokenizer.ggml.tokens": "tokens",
        "tokenizer.ggml.scores": "scores",
        "tokenizer.ggml.token_type": "token_type",
        "tokenizer.ggml.merges": "merges",
        "tokenizer.ggml.add_bos_token": "add_bos_token",
        "tokenizer.ggml.add_eos_token": "add_eos_token",
        "tokenizer.chat_template": "chat_template",
        **{f"tokenizer.ggml.{key}": key for key in (*_SPECIAL_IDS.values(), *_STOP_IDS)},
    }
    meta = {}
    for key, name in keys.items():
        field = reader.get_field(key)
        if field is not None:
            meta[name] = field.contents()
    return meta


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], split: str | None) -> RustTokenizer:
    """BPE over GPT-2's byte alphabet; a token spelled in other characters is re-spelled byte by byte."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    model = BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = RustTokenizer(model)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_file_tokens(backend: RustTokenizer, tokens: list[str], token_types: list[int], byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (matched whole).

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp
    mislabel: adding it would grow the vocabulary past the model's, so it is skipped, as
    transformers does.
    """
    alphabet = set(byte_alphabet().values())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and (not byte_level or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)
