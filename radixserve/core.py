"""Shared types every layer may use: sampling parameters and per-request results."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from typing_extensions import TypeIs

FinishReason = Literal["stop", "length", "abort"]
# Why a request failed: the engine broke on it (500), it lacked room now (503, retry), the server is stopping (503).
ErrorKind = Literal["engine", "capacity", "shutdown"]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
# Per generated token: the most likely (token id, logprob) pairs, best first.
TopLogprobs = list[tuple[int, float]]
# Scale-out's vocabulary, here so that `serve`'s flags (server/args.py) and the router that acts on them
# (router/table.py) share it without the server importing the router above it:
# --router: how a request picks a replica; round-robin and power-of-two are baselines.
ROUTER_POLICIES = ("cache-aware", "round-robin", "power-of-two")
# --router-index: a replica's cached prefixes from its KV events (precise), or from the prompts sent to it.
ROUTER_INDEXES = ("precise", "approximate")


def is_token_ids(prompt: object) -> TypeIs[Sequence[int]]:
    """One prompt of token ids (empty, or its first item an int): not a batch of prompts, nor text."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and (not prompt or isinstance(prompt[0], int))


def is_texts(prompt: object) -> TypeIs[Sequence[str]]:
    """A non-empty batch of text prompts."""
    return isinstance(prompt, list | tuple) and bool(prompt) and all(isinstance(p, str) for p in prompt)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (the SGLang / OpenAI field names).

    ``temperature == 0`` is greedy. Penalties follow OpenAI (frequency, presence:
    subtracted per occurrence / once, over generated tokens) and the CTRL paper
    (repetition: logits of tokens already in prompt or output divided if > 0,
    multiplied if < 0). ``seed`` makes a request reproducible on its own,
    whatever else is in its batch (on the same device type: CPU and CUDA
    generators differ).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # also return the N most likely tokens at each step (implies logprobs)
    # Constrained decoding (at most one; SGLang's names): the output must match this JSON schema / regex /
    # EBNF grammar (xgrammar's dialect). The request stops when the grammar is complete.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if problems:  # the range checks below assume the right types
            raise ValueError("; ".join(problems))
        if self.max_new_tokens < 0:
            problems.append(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))  # "" would match everywhere
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the request's constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    @property
    def greedy(self) -> bool:
        # Below 1e-5 a division by the temperature overflows to inf/NaN: treat it as greedy.
        return self.temperature < 1e-5 or self.top_k == 1

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SamplingParams:
        """Build from a user's dict; unknown keys are an error, never ignored."""
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        return cls(**values)


_INTS = ("max_new_tokens", "top_k", "top_logprobs")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_INT_LIMIT = 1 << 63


def _type_problems(params: SamplingParams) -> list[str]:
    """Wrong types, non-finite floats, out-of-int64 ints: each named (a user's dict is untrusted)."""
    problems = []
    for name in _INTS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, int) or not -_INT_LIMIT < value < _INT_LIMIT:
            problems.append(f"{name} must be an integer, got {value!r}")
    for name in _FLOATS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{name} must be a finite number, got {value!r}")
    seed = params.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        problems.append(f"seed must be an integer in [0, 2^64), got {seed!r}")
    if (
        isinstance(params.stop, str)
        or not isinstance(params.stop, (list, tuple))
        or not all(isinstance(s, str) for s in params.stop)
    ):
        problems.append(f"stop must be a list of strings, got {params.stop!r}")
    ids = params.stop_token_ids
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        problems.append(f"stop_token_ids must be a list of integers, got {ids!r}")
    grammars = [name for name in ("json_schema", "regex", "ebnf") if getattr(params, name) is not None]
    for name in grammars:
        if not isinstance(getattr(params, name), str):
            problems.append(f"{name} must be a string, got {type(getattr(params, name)).__name__}")
    if len(grammars) > 1:
        problems.append(f"give at most one of json_schema, regex and ebnf, got {grammars}")
    for name in ("ignore_eos", "logprobs"):
        if not isinstance(getattr(params, name), bool):
            problems.append(f"{name} must be true or false, got {getattr(params, name)!r}")
    return problems


@dataclass(frozen=True)
class GenerateResult:
    """One request's outcome; ``to_dict`` gives the shape SGLang's native API returns."""

    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    e2e_latency: float
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    matched_stop: int | str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with ``error``
    # Prompt logprobs (SGLang's logprob_start_len): per prompt token from that start, log P(token | tokens
    # before it); the first is None (nothing before it was scored). None: not asked for.
    input_logprobs: list[float | None] | None = None
    # Per output token: where its text starts in ``text`` (after a stop string, the stop's tokens start
    # at or past its end): what OpenAI's logprobs ``text_offset`` counts.
    text_offsets: list[int] = field(default_factory=list)
    # An embedding request (``Request.return_hidden``): its last prompt token's final (normed) hidden state.
    hidden_state: list[float] | None = None
    # Speculative decoding: (draft tokens verified, of those accepted); None when it never drafted.
    spec: tuple[int, int] | None = None

    @property
    def retryable(self) -> bool:
        """The error was a transient lack of capacity: the same request may succeed later."""
        return self.error_kind == "capacity"

    def to_dict(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "e2e_latency": self.e2e_latency,
        }
        if self.output_logprobs:
            meta["output_token_logprobs"] = self.output_logprobs
        if self.output_top_logprobs:
            meta["output_top_logprobs"] = [[list(pair) for pair in step] for step in self.output_top_logprobs]
        if self.input_logprobs is not None:
            meta["input_token_logprobs"] = self.input_logprobs
        if self.spec is not None:
            meta["spec_draft_tokens"], meta["spec_accept_tokens"] = self.spec
            # SGLang's figure: output tokens per forward of this request (1.0 without speculation)
            steps = len(self.output_ids) - self.spec[1]
            meta["spec_accept_length"] = len(self.output_ids) / steps if steps > 0 else 0.0
        if self.error is not None:
            meta["error"] = self.error
            meta["retryable"] = self.retryable
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}
