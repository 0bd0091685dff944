"""A transformers fast tokenizer built straight from a GGUF's tokenizer metadata with ``tokenizers``.

transformers builds it too (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``), but parses
the whole file twice with its own reader and builds the vocabulary through a Python tokenizer
class: 10-12 s of SmolLM2's start-up. The same metadata is already parsed by the reader the
weights come from (``gguf_loader.GGUFReader``); here it goes into the same ``tokenizers``
pipeline transformers builds (a byte-level BPE model, its pre-tokenizer and decoder, the
file's control and user-defined tokens), wrapped in ``PreTrainedTokenizerFast`` with the
same special tokens and flags. Tests compare encodes, decodes and the serialised pipeline
with transformers' own build.

Handled exactly: a llama-architecture file with ``tokenizer.ggml.model == "gpt2"`` (byte-level
BPE with merges) and a ``tokenizer.ggml.pre`` in ``PRE_TOKENIZER_SPLITS``. Anything else raises
``UnsupportedGGUFTokenizer`` with the reason; the caller falls back to transformers.
"""

from __future__ import annotations

import functools
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (tokenizer.ggml.token_type)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex transformers puts before a byte-level step without its own
# regex; None: GPT-2's byte-level regex alone (what transformers gives every pre it does not list).
# NB "smollm": llama.cpp also splits each digit apart first (as SmolLM2's own tokenizer.json does);
# transformers does not, and we follow transformers, so both paths tokenize alike.
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


class UnsupportedGGUFTokenizer(ValueError):
    """This file's tokenizer is not one we build exactly: use transformers' conversion."""


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
    arch, name = meta.get("architecture"), str(meta.get("name", "")).lower()
    if arch != "llama" or "mistral" in name:  # transformers may pick a model-specific class for others
        raise UnsupportedGGUFTokenizer(f"architecture {arch!r} ({name!r}): only llama is checked against transformers")
    if meta.get("tokenizer_type") != "gpt2":
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.model {meta.get('tokenizer_type')!r} is not byte-level BPE")
    if meta.get("pre") not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.pre {meta.get('pre')!r} is not in our table")
    tokens: list[str] = meta["tokens"]
    pairs = [merge.split(" ") for merge in meta.get("merges", ())]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise UnsupportedGGUFTokenizer("no merges (transformers derives them from scores), or a malformed merge")
    backend = _byte_level_bpe(tokens, [(left, right) for left, right in pairs], PRE_TOKENIZER_SPLITS[meta["pre"]])
    _add_file_tokens(backend, tokens, meta.get("token_type") or [])
    # The keyword arguments transformers passes (get_gguf_tokenizer): flags only where the file has them.
    config: dict[str, Any] = {k: meta[k] for k in ("chat_template", "add_bos_token", "add_eos_token") if k in meta}
    for name, key in _SPECIAL_IDS.items():
        config[name] = tokens[meta[key]] if key in meta else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)  # type: ignore[no-untyped-call]


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The tokenizer keys of the file, named as in llama.cpp's ``tokenizer.ggml.*`` / ``tokenizer.*``."""
    keys = {
        "general.architecture": "architecture",
        "general.name": "name",
        "tokenizer.ggml.model": "tokenizer_type",
        "tokenizer.ggml.pre": "pre",
        "tokenizer.ggml.tokens": "tokens",
        "tokenizer.ggml.token_type": "token_type",
        "tokenizer.ggml.merges": "merges",
        "tokenizer.ggml.add_bos_token": "add_bos_token",
        "tokenizer.ggml.add_eos_token": "add_eos_token",
        "tokenizer.chat_template": "chat_template",
        **{f"tokenizer.ggml.{key}": key for key in _SPECIAL_IDS.values()},
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


def _add_file_tokens(backend: RustTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (matched whole).

    A control token spelled outside the byte alphabet is a llama.cpp mislabel: adding it would
    grow the vocabulary past the model's, so it is skipped, as transformers does.
    """
    alphabet = set(byte_alphabet().values())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and set(token) <= alphabet
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
