"""Tokenizer, chat template, streaming detokenisation and stop strings.

``Tokenizer`` wraps a transformers fast tokenizer loaded strictly offline, either from an
HF folder (``tokenizer.json`` + ``tokenizer_config.json``) or from a GGUF file's embedded
vocabulary (built from the metadata our reader parsed, ``gguf_tokenizer.py``). Chat templates are
the model's own (GGUF ``tokenizer.chat_template``, chat_template.jinja, tokenizer_config.json) or a
file given with ``--chat-template``, rendered by transformers' ``apply_chat_template`` (a jinja2
sandbox with ``bos_token`` / ``eos_token``, ``raise_exception``, ``add_generation_prompt``).
``IncrementalDecoder``
turns output ids into text deltas that never split a multi-byte character; ``find_stop`` /
``partial_stop_len`` implement stop strings. The engine's output stage (``engine/output.py``)
runs one ``IncrementalDecoder`` per request: the one place output text is made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import gguf
from transformers import PreTrainedTokenizerBase

from radixserve.model.gguf_loader import GGUFReader, default_model_path
from radixserve.model.gguf_tokenizer import build_gguf_tokenizer, gguf_stop_token_ids, gguf_tokenizer_kind

# Chat templates end a turn with one of these; generation must stop on it as well as on eos.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
# Prompt tokens an IncrementalDecoder keeps as context, so a first output token decodes as
# it would mid-text (SentencePiece decoders drop a space at the start of a decode).
DECODE_CONTEXT_TOKENS = 5
_TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")  # where an HF folder keeps its template


class NoChatTemplate(ValueError):
    """The model has no chat template and none was given: the message names the flag."""


class Tokenizer:
    """Encode, decode and chat-template for one model; build with a ``from_*`` constructor.

    ``stop_token_ids``: the ids the model's files say end a generation besides eos (a GGUF's
    ``tokenizer.ggml.eot_token_id``, an HF folder's generation_config.json); ``chat_template_source``:
    where the template came from, for the start-up report."""

    def __init__(
        self,
        hf: PreTrainedTokenizerBase,
        chat_template: str | None = None,
        stop_token_ids: Sequence[int] = (),
        chat_template_source: str | None = None,
    ) -> None:
        self.hf = hf
        self.chat_template: str | None = chat_template or hf.chat_template
        self.chat_template_source: str = (chat_template_source or "the tokenizer") if self.chat_template else "none"
        self.vocab_size: int = len(hf)
        self._stop_token_ids = tuple(stop_token_ids)
        self.kind = "HF tokenizer.json"  # what the files hold, for the start-up report; from_gguf says more
        self.eos_token_ids: tuple[int, ...] = self._find_eos_ids()

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a folder holding ``tokenizer.json`` / ``tokenizer_config.json``; never touches the network.

        transformers reads the chat template from chat_template.jinja (first) or tokenizer_config.json."""
        folder = Path(path)
        hf = _auto_tokenizer().from_pretrained(str(folder), local_files_only=True)
        source = next(
            (f"{folder.name}/{n}" for n in _TEMPLATE_FILES if (folder / n).is_file()), "tokenizer_config.json"
        )
        return cls(hf, stop_token_ids=_generation_config_eos(folder), chat_template_source=source)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], reader: gguf.GGUFReader | None = None) -> Tokenizer:
        """From the vocabulary, merges and chat template embedded in a GGUF file (offline).

        ``reader``: the file already open (the weights' loader), so it is parsed once. A tokenizer
        ``gguf_tokenizer`` does not build is an ``UnsupportedGGUFTokenizer`` naming the ones it does."""
        reader = reader or GGUFReader(Path(path))
        hf = build_gguf_tokenizer(reader)
        tok = cls(hf, stop_token_ids=gguf_stop_token_ids(reader), chat_template_source="GGUF tokenizer.chat_template")
        tok.kind = gguf_tokenizer_kind(reader)
        return tok

    @classmethod
    def from_model_path(
        cls, path: str | os.PathLike[str] | None = None, gguf_reader: gguf.GGUFReader | None = None
    ) -> Tokenizer:
        """From a ``.gguf`` file (``gguf_reader``: that file, already open) or an HF folder; None means
        the embedded default model."""
        target = Path(default_model_path() if path is None else path)
        if target.is_file() and target.suffix == ".gguf":
            return cls.from_gguf(target, gguf_reader)
        if target.is_dir() and any((target / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            return cls.from_hf_folder(target)
        raise FileNotFoundError(f"{target} is neither a .gguf file nor a folder with tokenizer.json")

    def with_chat_template(self, path: str | os.PathLike[str] | None) -> Tokenizer:
        """This tokenizer with the chat template of a Jinja file (``--chat-template``) instead of its
        own; itself when ``path`` is None."""
        if path is None:
            return self
        template = Path(path).read_text(encoding="utf-8")
        tok = Tokenizer(self.hf, template, self._stop_token_ids, f"--chat-template {path}")
        tok.kind = self.kind
        return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens (e.g. BOS) the model's tokenizer adds."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; tokenization-space cleanup is off so decodes concatenate exactly."""
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
        return str(text)

    def decode_continuation(self, output_ids: Sequence[int], prompt_ids: Sequence[int] = ()) -> str:
        """Text of ``output_ids`` as it reads after the prompt: what ``IncrementalDecoder`` streams.

        Decoded after the prompt's last few tokens, so a first token keeps the space a
        SentencePiece or word-level decoder would drop at the start of a text.
        """
        context = list(prompt_ids[-DECODE_CONTEXT_TOKENS:])
        if not context:
            return self.decode(output_ids)
        return self.decode(context + list(output_ids))[len(self.decode(context)) :]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template applied to ``messages``, as text (special tokens written out)."""
        if not self.chat_template:
            raise self.no_chat_template()
        text = self.hf.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        return str(text)

    def no_chat_template(self) -> NoChatTemplate:
        """The error for a chat request to a model without a template: it names the flag that gives one."""
        return NoChatTemplate(
            "this model has no chat template (none in its GGUF or tokenizer_config.json): start the server "
            "with --chat-template PATH (a Jinja file), or send the prompt as text to /v1/completions"
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt ids for ``messages``. Rendered to text and encoded without extra special tokens
        (the template writes its own), as HF does; transformers 5 would return a BatchEncoding."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    def _find_eos_ids(self) -> tuple[int, ...]:
        """eos, the files' own stop ids, and the end-of-turn tokens the chat template writes."""
        ids: list[int] = [] if self.hf.eos_token_id is None else [int(self.hf.eos_token_id)]
        ids += [i for i in self._stop_token_ids if i not in ids]
        vocab = self.hf.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if self.chat_template and token in self.chat_template and token in vocab and vocab[token] not in ids:
                ids.append(vocab[token])
        return tuple(ids)


def _generation_config_eos(folder: Path) -> tuple[int, ...]:
    """The eos ids an HF folder's generation_config.json lists (Llama 3: end of text, of turn, of message)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))


def _auto_tokenizer() -> Any:
    """transformers' AutoTokenizer, imported on use: its import (the auto mappings) took 1.3 s of a
    start-up that a GGUF built by ``gguf_tokenizer`` never needs."""
    from transformers import AutoTokenizer

    return AutoTokenizer


class IncrementalDecoder:
    """Text deltas for a growing list of output ids; never emits half a UTF-8 character.

    A byte-level token may end inside a character: its decode then ends in U+FFFD. We
    decode a short window, ``ids[prefix_offset:]``, and emit only what it adds beyond
    ``ids[prefix_offset:read_offset]`` (already emitted), and only once it no longer ends in
    U+FFFD; then the window slides forward. Concatenated deltas plus ``flush()`` equal
    ``decode(all output ids)``. Each push decodes the window twice: a few tokens, whatever
    the output's length.

    Why not ``tokenizers``' ``DecodeStream`` (the same window algorithm, in Rust): it has no
    ``flush``, so an output that ends inside a character would lose its last U+FFFD that
    ``decode`` (and so ``decode_continuation``) keeps.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-DECODE_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._deltas: list[str] = []
        # Decoded but not emitted (a character still incomplete, so it may end in U+FFFD): what
        # flush() would emit now.
        self.pending = ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._deltas)

    def push(self, new_ids: Iterable[int]) -> str:
        """Append output ids; return the new text that is now complete (may be empty)."""
        self._ids.extend(new_ids)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            self.pending = window_text[len(prefix_text) :]
            return ""  # nothing new yet, or a character still incomplete
        return self._emit(window_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of generation: emit whatever was held back (e.g. a real U+FFFD)."""
        prefix_text, window_text = self._decode_window()
        return self._emit(window_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        prefix_text = self._tokenizer.decode(window[: self._read_offset - self._prefix_offset], self._skip_special)
        return prefix_text, self._tokenizer.decode(window, self._skip_special)

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._deltas.append(delta)
        self.pending = ""
        return delta


class StopMatch(NamedTuple):
    """Result of ``find_stop``: the text before the stop string, and which stop matched."""

    text: str
    stop: str


def find_stop(text: str, stops: Iterable[str], start: int = 0) -> StopMatch | None:
    """The earliest stop string in ``text[start:]`` (the longest one on a tie), or None.

    A streamer passes ``start = len(previous_text) - max(len(s) for s in stops) + 1`` so each
    step scans only the tail that could hold a new match.
    """
    best: tuple[int, int, str] | None = None  # (position, -length, stop)
    for stop in stops:
        pos = text.find(stop, max(start, 0)) if stop else -1
        if pos >= 0 and (best is None or (pos, -len(stop)) < best[:2]):
            best = (pos, -len(stop), stop)
    return None if best is None else StopMatch(text[: best[0]], best[2])


def partial_stop_len(text: str, stops: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string.

    A streamer holds that many characters back: the next tokens may complete the stop.
    """
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held
