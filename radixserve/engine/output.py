"""The output stage: the one place a request's output advances, one taken token at a time.

The step samples and changes no request. ``Scheduler.process`` decides which requests take
their token and hands each here (``OutputStage.append``), which

- appends the id and its logprobs and advances the request's sampling state (penalties, grammar);
- decodes it with the request's ``IncrementalDecoder``: complete characters only, a few tokens
  decoded per step whatever the output's length;
- checks stop tokens, then stop strings on the new text only: a search covers the text held back
  (shorter than the longest stop string) plus the new text, so checks cost O(output length) in
  all; the earliest match wins, the longest on a tie (``find_stop``);
- releases into ``req.text_pieces`` the text that can no longer become a stop string.

``finish`` writes the final text, ``req.text``: the released pieces, plus the rest once the
request ends without a stop string (then nothing is held back). So the text streamed and the
text returned are one text, made once.

``OutputCursor`` hands a reader (a server stream) what is new since its last look: tokens, text,
and the tokens whose logprobs a choice lists. Which tokens that is, the same streamed or not:

- a token "starts" where the output's text before it ends (``req.text_offsets``: what OpenAI's
  ``text_offset`` counts); a token is listed once the text released so far reaches past its start,
  so the text held back while a stop string may form holds back its tokens too;
- once finished every token is listed, except after a stop string: the tokens that start at or past
  the end of the returned text (the stop string's, which the text leaves out) never are.

A whole answer applies the same rule once (``listed_tokens``), so a stream's logprobs,
concatenated, equal the whole answer's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from radixserve.core import FinishReason, GenerateResult, TopLogprobs
from radixserve.model.tokenizer import DECODE_CONTEXT_TOKENS, IncrementalDecoder, Tokenizer, find_stop, partial_stop_len
from radixserve.scheduler.batch import StepOutput
from radixserve.scheduler.request import Request


@dataclass(eq=False)
class _Text:
    """One running request's detokenizer and the text it holds back."""

    decoder: IncrementalDecoder
    held: str = ""  # decoded, not released: it may still become a stop string (shorter than the longest)
    length: int = 0  # characters decoded (released + held)
    stopped: bool = False  # a stop string matched: the released text is final


class OutputStage:
    """Per request: ids, logprobs, sampling state and text, advanced once per taken token."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._texts: dict[Request, _Text] = {}  # running requests that have taken a token

    def make_decoder(self, req: Request) -> IncrementalDecoder:
        """The request's detokenizer: reads on from the prompt's last tokens."""
        return IncrementalDecoder(self.tokenizer, req.prompt_ids[-DECODE_CONTEXT_TOKENS:].tolist())

    def append(self, req: Request, out: StepOutput) -> int | str | None:
        """Take ``out.token`` into ``req``; what it stopped on (its matched_stop), or None.

        In order: a stop token (eos unless ignored, ``stop_token_ids``), a stop string, the grammar's end
        (it took its stop token: with ignore_eos nothing else would stop it).
        Raises (``req`` alone should fail) when its detokenizer or its grammar breaks; the id is kept.
        """
        token = out.token
        assert token is not None
        req.output_ids.append(token)
        if out.logprob is not None:
            req.output_logprobs.append(out.logprob)
        if out.top_logprobs is not None and req.params.top_logprobs:
            req.output_top_logprobs.append(out.top_logprobs)
        req.sampling.append(token)
        stops_on_token = req.stops_on(token, self.eos_token_ids)
        stop_string = self._decode(req, token, search=not stops_on_token)
        grammar = req.sampling.grammar
        if stops_on_token or (stop_string is None and grammar is not None and grammar.terminated):
            return token
        return stop_string

    def finish(self, req: Request, keep_text: bool = True) -> None:
        """``req`` ends: ``req.text`` is its whole text (``keep_text=False``, it failed: ""); its decoder goes."""
        state = self._texts.pop(req, None)
        if not keep_text:
            req.text = ""
            return
        if state is not None and not state.stopped:
            _release(req, state.held + state.decoder.flush())
        req.text = "".join(req.text_pieces)

    def _decode(self, req: Request, token: int, search: bool) -> str | None:
        """Decode ``token``, release what is final; the stop string it completes (``search``), or None."""
        state = self._texts.get(req)
        if state is None:
            state = self._texts[req] = _Text(self.make_decoder(req))
        req.text_offsets.append(state.length)
        new = state.decoder.push([token])
        state.length += len(new)
        stops = req.params.stop
        if search and stops:
            # No match can start before the held text: it would have been found, or held, earlier.
            # The decoder's pending text (a character still incomplete) counts, as a full decode would.
            match = find_stop(state.held + new + state.decoder.pending, stops)
            if match is not None:
                _release(req, match.text)
                state.held, state.stopped = "", True
                return match.stop
        text = state.held + new
        held_len = partial_stop_len(text, stops) if stops else 0
        _release(req, text[: len(text) - held_len])
        state.held = text[len(text) - held_len :]
        return None


def _release(req: Request, text: str) -> None:
    if text:
        req.text_pieces.append(text)


class LogprobTokens(NamedTuple):
    """Tokens a choice's logprobs list, with where each starts in the choice's text."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[TopLogprobs]
    starts: list[int]


class _Output(Protocol):
    """A request's output as a ``Request`` holds it and a ``GenerateResult`` returns it."""

    @property
    def output_ids(self) -> list[int]: ...
    @property
    def output_logprobs(self) -> list[float]: ...
    @property
    def output_top_logprobs(self) -> list[TopLogprobs]: ...
    @property
    def text_offsets(self) -> list[int]: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...
    @property
    def matched_stop(self) -> int | str | None: ...


def listed_len(out: _Output, released_len: int) -> int:
    """How many leading tokens a choice lists: those starting before the ``released_len`` characters
    released; once finished all of them, except after a stop string (see the module docstring)."""
    if out.finish_reason is not None and not isinstance(out.matched_stop, str):
        return len(out.text_offsets)
    return bisect_left(out.text_offsets, released_len)


def _logprob_tokens(out: _Output, start: int, end: int) -> LogprobTokens:
    return LogprobTokens(
        out.output_ids[start:end],
        out.output_logprobs[start:end],
        out.output_top_logprobs[start:end],
        out.text_offsets[start:end],
    )


def listed_tokens(result: GenerateResult) -> LogprobTokens:
    """A finished choice's listed tokens (a whole answer: its stream's, concatenated)."""
    return _logprob_tokens(result, 0, listed_len(result, len(result.text)))


class OutputChunk(NamedTuple):
    """What a request produced since a reader's last look."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]
    text: str  # never past a stop string, never half a character
    listed: LogprobTokens  # the tokens whose logprobs its choice now lists


@dataclass
class OutputCursor:
    """How far one reader has taken one request's output (read on the thread that steps the engine)."""

    tokens: int = 0
    pieces: int = 0
    chars: int = 0
    listed: int = 0

    def take(self, req: Request) -> OutputChunk:
        text = "".join(req.text_pieces[self.pieces :])
        self.pieces, self.chars = len(req.text_pieces), self.chars + len(text)
        start, self.tokens = self.tokens, len(req.output_ids)
        first, self.listed = self.listed, max(self.listed, listed_len(req, self.chars))
        new = _logprob_tokens(req, start, self.tokens)
        return OutputChunk(new.token_ids, new.logprobs, new.top, text, _logprob_tokens(req, first, self.listed))
