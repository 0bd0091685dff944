"""Reasoning output (``--reasoning-parser``): a model's ``<think>...</think>`` goes into ``reasoning_content``.

As vLLM and SGLang do, a chat answer's text is split in two::

    <think>\\n I should add them. \\n</think>\\n\\n 4        message.reasoning_content  "I should add them."
                                                          message.content            "4"

The reasoning is the text between the tags, stripped; the content is what follows the end tag, its leading
whitespace dropped. The parsers differ only in where the output starts:

- ``deepseek-r1``, ``qwen3-thinking``: in the reasoning (their chat templates open ``<think>`` in the prompt;
  a ``<think>`` the model writes anyway is dropped). No end tag yet: all of it is reasoning, content is None.
- ``qwen3``: in the reasoning only if the output opens with ``<think>``; otherwise all of it is content
  (Qwen3 with thinking off writes no block, or an empty one).

Streaming, ``ReasoningStream`` splits each delta as it comes, holding back only what may still become a
tag or trailing whitespace (a few characters), so the deltas concatenate to exactly the whole answer's
fields: the whole answer is the same machine fed once (``split_reasoning``).

Structured output applies after the reasoning: with a parser, ``response_format``'s schema becomes a
grammar of an optional (qwen3) or open (deepseek-r1) reasoning block, then the schema (``after_reasoning``).
SGLang's raw ``regex`` extension constrains the whole output, reasoning included. A request with SGLang's
``separate_reasoning: false`` gets the raw text in ``content``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from radixserve.model.grammar import GrammarError, GrammarKind, grammar_after_text
from radixserve.server.errors import APIError

THINK_START, THINK_END = "<think>", "</think>"
# parser name -> whether the output starts inside the reasoning
REASONING_PARSERS: dict[str, bool] = {"deepseek-r1": True, "qwen3": False, "qwen3-thinking": True}


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may still become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One choice's text, fed delta by delta; ``feed`` and ``finish`` return what is now final."""

    forced: bool  # the output starts inside the reasoning
    mode: str = "start"  # start (before the first non-space character) -> reasoning -> content
    held: str = ""  # text not yet released: a possible tag, or whitespace that may prove trailing
    seen_reasoning: bool = False  # a reasoning block opened (the answer has reasoning_content)
    reasoning_started: bool = False  # released reasoning text (its leading whitespace is dropped)
    content_started: bool = False

    def feed(self, text: str) -> ReasoningDelta:
        self.held += text
        reasoning, content = [], []
        while self.held:
            before = (self.mode, len(self.held))
            if self.mode == "start":
                self._start()
            elif self.mode == "reasoning":
                reasoning.append(self._reasoning())
            else:
                content.append(self._content(self.held))
                self.held = ""
            if (self.mode, len(self.held)) == before:
                break  # waiting for more text
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The end of the output: release what was held (a partial tag is text after all)."""
        held, self.held = self.held, ""
        if self.mode == "start":
            self._enter("reasoning" if self.forced else "content")
        if self.mode == "reasoning":
            text = held.rstrip()
            return ReasoningDelta(text if self.reasoning_started else text.lstrip(), "")
        return ReasoningDelta("", self._content(held))

    def _enter(self, mode: str) -> None:
        self.mode = mode
        self.seen_reasoning = self.seen_reasoning or mode == "reasoning"

    def _start(self) -> None:
        stripped = self.held.lstrip()
        if not stripped:
            return  # leading whitespace: wait
        if stripped.startswith(THINK_START):
            self.held = stripped[len(THINK_START) :]
            self._enter("reasoning")
        elif THINK_START.startswith(stripped):
            return  # "<thi": wait
        else:
            self._enter("reasoning" if self.forced else "content")

    def _reasoning(self) -> str:
        """Release reasoning up to the end tag (then switch to content) or up to what must wait."""
        end = self.held.find(THINK_END)
        if end >= 0:
            text, self.held = self.held[:end].rstrip(), self.held[end + len(THINK_END) :]
            self.mode = "content"
        else:
            keep = _partial_suffix(self.held, THINK_END)
            body = self.held[: len(self.held) - keep]
            text = body.rstrip()
            self.held = body[len(text) :] + self.held[len(self.held) - keep :]
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer; reasoning None when there was no reasoning block,
    content None when a reasoning block left nothing after it (or never ended)."""
    stream = ReasoningStream(REASONING_PARSERS[parser])
    first, last = stream.feed(text), stream.finish()
    reasoning, content = first.reasoning + last.reasoning, first.content + last.content
    if not stream.seen_reasoning:
        return None, content
    return reasoning, content or None


def message_fields(parser: str | None, text: str) -> dict[str, Any]:
    """A chat answer's ``content`` (and ``reasoning_content`` when a parser is on)."""
    if parser is None:
        return {"content": text}
    reasoning, content = split_reasoning(parser, text)
    return {"content": content, "reasoning_content": reasoning}


def delta_fields(
    streams: dict[int, ReasoningStream], parser: str, index: int, text: str, final: bool
) -> dict[str, str]:
    """The streamed delta's ``reasoning_content`` / ``content`` for choice ``index``'s new ``text``."""
    stream = streams.setdefault(index, ReasoningStream(REASONING_PARSERS[parser]))
    new = stream.feed(text)
    if final:
        rest = stream.finish()
        new = ReasoningDelta(new.reasoning + rest.reasoning, new.content + rest.content)
    out = {}
    if new.reasoning:
        out["reasoning_content"] = new.reasoning
    if new.content:
        out["content"] = new.content
    return out


def after_reasoning(parser: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with a ``json_schema`` or ``ebnf`` constraint moved after the reasoning block (an ``ebnf``
    grammar). A ``regex`` (SGLang's raw extension) stays as it is: it spells the whole output."""
    kinds: tuple[GrammarKind, ...] = ("json_schema", "ebnf")
    kind = next((k for k in kinds if params.get(k) is not None), None)
    if kind is None:
        return params
    # The reasoning: any text but the end tag, then the end tag and blank lines (optional in qwen3 style).
    block = f"{_NOT_END}{THINK_END}\\s*"
    prefix = f"({THINK_START})?{block}" if REASONING_PARSERS[parser] else f"({THINK_START}{block})?"
    try:
        ebnf = grammar_after_text(prefix, kind, params[kind])
    except GrammarError as exc:
        raise APIError(400, str(exc), f"invalid_{kind}", "response_format" if kind == "json_schema" else kind) from None
    return {**{k: v for k, v in params.items() if k != kind}, "ebnf": ebnf}


# A regex for "any text without </think>": each alternative fails on a character that would break the tag,
# and never on "<", so a "<" always starts a fresh try at the tag.
_NOT_END = "([^<]|<[^/<]|</[^t<]|</t[^h<]|</th[^i<]|</thi[^n<]|</thin[^k<]|</think[^><])*"
