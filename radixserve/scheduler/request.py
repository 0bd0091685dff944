"""Request: one generation's state as it moves waiting -> running -> finished.

``kv`` is the part the prefix cache owns the bookkeeping of (see
``cache.base.CacheReq``): the tokens whose K/V is computed and their slots.
The newest sampled token has no K/V yet; the next decode step computes it::

    prompt_ids + output_ids[:-1]   K/V computed (kv.token_ids, kv.kv_indices)
    output_ids[-1]                 sampled, fed to the next decode step
"""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field

import numpy as np

from radixserve.cache import CacheReq, RadixKey
from radixserve.core import ErrorKind, FinishReason, GenerateResult, SamplingParams, TopLogprobs
from radixserve.model.grammar import GrammarState
from radixserve.model.sampling import SamplingState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class SpecState:
    """One request's speculative drafting (scheduler/draft.py): its acceptance estimate, cooldown, counters."""

    accepted: float = 1.0  # recent accepted draft tokens (decayed) ...
    trials: float = 2.0  # ... of recent draft tokens tried: alpha = accepted / trials (the prior: 1/2)
    cooldown: int = 0  # decode steps left without drafting
    skips: int = 0  # times in a row drafting did not pay (the next cooldown is 2**skips)
    probe: bool = False  # the next proposal drafts one token whatever alpha says
    forced: int = 0  # of the last proposal's drafts, the first ones its grammar forced (certain: no trial)
    num_draft_tokens: int = 0  # drafted and verified (meta_info's spec_draft_tokens)
    num_accepted_tokens: int = 0  # of those, accepted (spec_accept_tokens)
    num_verify_steps: int = 0


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: np.ndarray  # int64
    params: SamplingParams
    extra_key: str | None = None
    priority: int = 0  # schedule_policy=priority: higher first; also the cache eviction priority
    shared_len: int = 0  # leading prompt tokens in the shared namespace (an allowlisted public prefix)
    routing_key: str | None = None  # schedule_policy=routing-key
    # Prompt logprobs from this prompt position on (-1: none). The cache match stops there, so the
    # positions after it are computed and scored; ``input_logprobs`` fills in as the chunks run.
    logprob_start_len: int = -1
    input_logprobs: list[float | None] | None = None
    # An embedding request: its last prompt token's final hidden state, read out by the step that prefills it.
    return_hidden: bool = False
    hidden_state: np.ndarray | None = None
    status: Status = Status.WAITING
    match_len: int = 0  # cached prefix length found by the last scheduling round (policy input)
    match_node: object = None  # the cache node that match ended on (same round only)
    # The output, advanced one taken token at a time by the engine's output stage (engine/output.py).
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Its text as released so far, piece by piece: complete characters only, never a stop string nor
    # a tail that may still become one. Once finished the pieces are the whole text.
    text_pieces: list[str] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # per output token: where its text starts
    text: str = ""  # set when it finishes: the pieces joined (the stop string cut; "" after an error)
    kv: CacheReq | None = None
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    prefill_done: bool = False  # this admission's prefill has produced a token
    chunk_start: int = 0  # where in kv.token_ids this step's prefill chunk starts
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with ``error``: see core.ErrorKind
    num_retractions: int = 0
    computed_len: int = 0  # tokens whose K/V it had computed when last retracted
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    admit_time: float | None = None  # its first admission: the end of its queueing
    first_token_time: float | None = None
    finish_time: float | None = None
    spec: SpecState | None = None  # set at its first decode step when speculative decoding is on
    sampling: SamplingState = field(init=False, repr=False)  # seed, penalties, grammar
    grammar: InitVar[GrammarState | None] = None  # the compiled constraint its params ask for

    def __post_init__(self, grammar: GrammarState | None) -> None:
        self.sampling = SamplingState(self.params, self.prompt_ids.tolist(), grammar)

    def ask_prompt_logprobs(self, start: int) -> None:
        """Score the prompt from position ``start`` (clipped to the prompt; negative: don't)."""
        if start < 0:
            return
        self.logprob_start_len = min(start, len(self.prompt_ids) - 1)
        self.input_logprobs = [None] * (len(self.prompt_ids) - self.logprob_start_len)

    def stops_on(self, token: int, eos_token_ids: frozenset[int]) -> bool:
        """``token`` ends this request: an EOS (unless ignored) or one of its stop token ids."""
        return token in eos_token_ids and not self.params.ignore_eos or token in self.params.stop_token_ids

    def finish(self, reason: FinishReason, error: str | None = None, kind: ErrorKind = "engine") -> None:
        """Mark it finished (the scheduler frees its slots first; see ``Scheduler.abort``)."""
        self.finish_reason = reason
        self.error = error
        self.error_kind = kind if error is not None else None
        self.status = Status.ABORTED if reason == "abort" else Status.FINISHED
        self.finish_time = time.perf_counter()

    @property
    def fill_ids(self) -> np.ndarray:
        """What an admission prefills: the prompt, plus every output token when resuming.

        The last of them is run even if cached: its logits give the next token.
        """
        if not self.output_ids:
            return self.prompt_ids
        return np.concatenate([self.prompt_ids, np.asarray(self.output_ids, dtype=np.int64)])

    @property
    def match_key(self) -> RadixKey:
        """What admission looks up in the cache: ``fill_ids`` but the last token, in the request's namespaces.

        The last token always runs (its logits give the next token), so it is never matched. Prompt logprobs:
        the positions to score must run too (only until the first token: then they are all scored).
        """
        fill = self.fill_ids
        limit = len(fill) - 1
        if self.input_logprobs is not None and not self.output_ids:
            limit = min(limit, self.logprob_start_len)
        return RadixKey(fill[:limit], self.extra_key, self.shared_len)

    def result(self) -> GenerateResult:
        assert self.finish_reason is not None and self.finish_time is not None
        return GenerateResult(
            text=self.text,
            output_ids=list(self.output_ids),
            text_offsets=list(self.text_offsets),
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens,
            finish_reason=self.finish_reason,
            e2e_latency=self.finish_time - self.arrival_time,
            output_logprobs=list(self.output_logprobs),
            output_top_logprobs=list(self.output_top_logprobs),
            matched_stop=self.matched_stop,
            error=self.error,
            error_kind=self.error_kind,
            input_logprobs=None if self.input_logprobs is None else list(self.input_logprobs),
            hidden_state=None if self.hidden_state is None else self.hidden_state.tolist(),
            spec=None if self.spec is None else (self.spec.num_draft_tokens, self.spec.num_accepted_tokens),
        )
