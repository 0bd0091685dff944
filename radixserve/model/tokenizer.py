"""Tokenizer, chat template, streaming detokenisation and stop strings.

``Tokenizer`` wraps a transformers fast tokenizer loaded strictly offline, either from an
HF folder (``tokenizer.json`` + ``tokenizer_config.json``) or from a GGUF file's embedded
vocabulary (built from the metadata our reader parsed, ``gguf_tokenizer.py``), with the model's
chat template and stop tokens (``chat_template.py``). ``IncrementalDecoder`` turns output ids
into text deltas that never split a multi-byte character; ``find_stop`` / ``partial_stop_len``
implement stop strings. The engine's output stage (``engine/output.py``) runs one
``IncrementalDecoder`` per request: the one place output text is made.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import gguf
from transformers import PreTrainedTokenizerBase

from radixserve.model.chat_template import (
    NoChatTemplate,
    default_template,
    generation_config_eos,
    hf_folder_template_source,
    read_chat_template,
    stop_ids,
)
from radixserve.model.gguf_loader import GGUFReader, default_model_path
from radixserve.model.gguf_tokenizer import build_gguf_tokenizer, gguf_stop_token_ids, gguf_tokenizer_kind

# Prompt tokens an IncrementalDecoder keeps as context, so a first output token decodes as
# it would mid-text (SentencePiece decoders drop a space at the start of a decode).
DECODE_CONTEXT_TOKENS = 5


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
        kind: str = "HF tokenizer.json",
    ) -> None:
        self.hf = hf
        self.chat_template: str | None = chat_template or default_template(hf.chat_template)
        self.chat_template_source: str = (chat_template_source or "the tokenizer") if self.chat_template else "none"
        self.kind = kind  # what the files hold, in words, for the start-up report
        self.vocab_size: int = len(hf)
        self._stop_token_ids = tuple(stop_token_ids)
        # eos, the files' own stop ids, the end-of-turn tokens the template writes
        self.eos_token_ids = stop_ids(hf.eos_token_id, stop_token_ids, self.chat_template, hf.get_vocab())

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a folder holding ``tokenizer.json`` / ``tokenizer_config.json``; never touches the network.

        transformers reads the chat template from chat_template.jinja (first) or tokenizer_config.json."""
        folder = Path(path)
        hf = _auto_tokenizer().from_pretrained(str(folder), local_files_only=True)
        return cls(hf, None, generation_config_eos(folder), hf_folder_template_source(folder))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], reader: gguf.GGUFReader | None = None) -> Tokenizer:
        """From the vocabulary, merges and chat template embedded in a GGUF file (offline).

        ``reader``: the file already open (the weights' loader), so it is parsed once. A tokenizer
        ``gguf_tokenizer`` does not build is an ``UnsupportedGGUFTokenizer`` naming the ones it does."""
        reader = reader or GGUFReader(Path(path))
        stops, kind = gguf_stop_token_ids(reader), gguf_tokenizer_kind(reader)
        return cls(build_gguf_tokenizer(reader), None, stops, "GGUF tokenizer.chat_template", kind)

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
        template = read_chat_template(path)
        return Tokenizer(self.hf, template, self._stop_token_ids, f"--chat-template {path}", self.kind)

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
            raise NoChatTemplate()
        text = self.hf.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        return str(text)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt ids for ``messages``. Rendered to text and encoded without extra special tokens
        (the template writes its own), as HF does; transformers 5 would return a BatchEncoding."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


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
