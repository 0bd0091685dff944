"""Scheduler counters: what the server exports as metrics, and what the benchmarks print.

``recent`` keeps the timings of the last ``RECENT_REQUESTS`` finished requests (queue, prefill,
decode), a small ring: the dashboard's request timeline reads it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import NamedTuple

RECENT_REQUESTS = 64


class RequestTiming(NamedTuple):
    """One finished request's life, in ``time.perf_counter`` seconds (None: it never got that far)."""

    rid: int
    extra_key: str | None  # its cache namespace: a tenant sees only its own
    arrival: float
    admitted: float | None  # first admission: queueing ends
    first_token: float | None  # prefill ends
    finish: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission: the hit rate's denominator)
    prefill_tokens: int = 0  # prompt tokens actually computed (extend steps)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    generated_tokens: int = 0  # output tokens sampled
    retractions: int = 0
    decode_retractions: int = 0  # retracted after decoding began (resuming re-feeds its newest token)
    recomputed_tokens: int = 0  # tokens a resumed request had computed before and lost to eviction
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verify_steps: int = 0  # decode steps of a request that verified drafts
    finished: Counter[str] = field(default_factory=Counter)  # by finish_reason
    recent: deque[RequestTiming] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))

    def count_finish(self, timing: RequestTiming) -> None:
        self.finished[timing.finish_reason] += 1
        self.recent.append(timing)

    def snapshot(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "retractions": self.retractions,
            "decode_retractions": self.decode_retractions,
            "recomputed_tokens": self.recomputed_tokens,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            # tokens per verify step (accepted drafts + the model's own), named as SGLang's internal_states
            "avg_spec_accept_length": (
                1 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else None
            ),
            "finished": dict(self.finished),
        }
