"""Which sampled tokens a choice's logprobs list: the ones its returned text shows, the same streamed or not.

A token "starts" where the choice's text before it ends (decoded incrementally after the
prompt, exactly as the returned text is: that is what ``text_offset`` counts). A token is
listed once the text sent so far reaches its start:

- streaming, the text held back while a stop string may still form holds back its
  tokens too, so a chunk's ``text_offset`` never points past the text sent;
- at the end, after a stop string matched, the tokens that start at or past the end of
  the returned text (the stop string's, which the text leaves out) are not listed.

Whole answers apply the same rule once, so a stream's logprobs, concatenated, equal the
whole answer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from radixserve.core import GenerateResult, TopLogprobs
from radixserve.model.tokenizer import IncrementalDecoder, Tokenizer


class Released(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]
    top: list[TopLogprobs]
    starts: list[int]  # each token's offset in the choice's generated text


class LogprobCursor:
    """One choice's sampled tokens, released as the text sent covers them."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[TopLogprobs] = []
        self.starts: list[int] = []
        self.released = 0

    def push(self, token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[TopLogprobs]) -> None:
        for token_id in token_ids:
            self.starts.append(len(self._decoder.text))
            self._decoder.push([token_id])
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.top.extend(top)

    def release(self, visible_chars: int | None) -> Released:
        """The tokens not yet released that start before ``visible_chars`` (None: all of them)."""
        stop = len(self.token_ids)
        if visible_chars is not None:
            while stop > self.released and self.starts[stop - 1] >= visible_chars:
                stop -= 1
        start, self.released = self.released, max(self.released, stop)
        end = self.released
        return Released(
            self.token_ids[start:end], self.logprobs[start:end], self.top[start:end], self.starts[start:end]
        )


def final_visible(result: GenerateResult) -> int | None:
    """How much of the text the final release may cover: the text's length after a stop string, else all."""
    return len(result.text) if isinstance(result.matched_stop, str) else None


def whole(cursor: LogprobCursor, result: GenerateResult) -> Released:
    """A finished choice's listed tokens (non-streaming), from its fresh cursor."""
    cursor.push(result.output_ids, result.output_logprobs, result.output_top_logprobs)
    return cursor.release(final_visible(result))
