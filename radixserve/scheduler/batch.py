"""What the scheduler hands the engine step, and what the step hands back.

``Scheduler.schedule()`` returns a ``ScheduledBatch``: per request, its mode,
the tokens to compute and the slots of its whole context. The engine step runs
the forward and samples, and returns one ``StepOutput`` per entry; it never
changes a request. ``Scheduler.process(batch, outputs)`` applies them: it decides
which requests take their token and hands each to the ``OutputStage`` (the
engine's ``engine/output.py``: ids, logprobs, sampling state, text, stop checks),
then finishes those that stopped.

Each entry carries its own mode: with ``enable_mixed_chunk`` one forward carries a
prefill chunk next to the running decodes (``ScheduledBatch.mode`` is then "mixed").
A "verify" entry is a decode with drafts (speculative decoding): its newest token and
``num_draft_tokens`` drafted ones, computed as one short extend; its ``StepOutput`` takes
the accepted drafts and one more token (``more``). A step with one is "mixed" too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from radixserve.core import TopLogprobs
from radixserve.scheduler.request import Request

Mode = Literal["extend", "decode", "verify"]
BatchMode = Literal["extend", "decode", "mixed"]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step."""

    req: Request
    mode: Mode
    new_token_ids: np.ndarray  # int64: the tokens whose K/V this step computes
    context_slots: np.ndarray  # int64: the whole context's slots (cached prefix first, then the new tokens)
    sample: bool  # False: a prefill chunk that is not the prompt's last, so no token comes out
    num_draft_tokens: int = 0  # verify: the last this many new tokens are drafts


@dataclass(frozen=True)
class ScheduledBatch:
    entries: tuple[ScheduledRequest, ...] = ()
    # Requests that ended while scheduling (no room, ever): process() reports them as finished too.
    finished: tuple[Request, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def reqs(self) -> list[Request]:
        return [entry.req for entry in self.entries]

    @property
    def mode(self) -> BatchMode:
        """The entries' one mode, or "mixed" when prefill chunks and decodes share the step."""
        modes = {entry.mode for entry in self.entries}
        if not modes:
            raise ValueError("an empty batch has no mode")
        mode = modes.pop() if len(modes) == 1 else "mixed"
        return "mixed" if mode == "verify" else mode


@dataclass(frozen=True)
class StepOutput:
    """One entry's outcome; the default is a prefill chunk that ran and produced no token."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None
    computed: bool = True  # the forward ran for it (its K/V is written)
    # Prompt logprobs this chunk scored: (prompt position, log P(token there | tokens before)).
    prompt_logprobs: tuple[tuple[int, float], ...] = ()
    error: str | None = None  # the step failed for this request alone (no token): it aborts, its K/V is never cached
    hidden: np.ndarray | None = None  # float32 [hidden]: the last prompt token's final hidden state (return_hidden)
    # verify: ``token`` and then ``more`` are the step's tokens in order: the accepted drafts, then the token the
    # model chose after the last of them (so len(more) drafts were accepted)
    more: tuple[StepOutput, ...] = ()


class OutputStage(Protocol):
    """Where a taken token goes: the one place a request's output advances (engine/output.py)."""

    def append(self, req: Request, out: StepOutput) -> int | str | None:
        """Take ``out.token`` into ``req``; what it stopped on (matched_stop: a token id or a stop
        string), or None. Raises if only this request should fail (its detokenizer, its grammar)."""
        ...

    def finish(self, req: Request, keep_text: bool) -> None:
        """``req`` ends: write its final text (``keep_text=False``, it failed: ""), drop its decoder."""
        ...
