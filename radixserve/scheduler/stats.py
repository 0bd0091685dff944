"""Scheduler counters: what the server exports as metrics, and what the benchmarks print."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    prefill_tokens: int = 0  # prompt tokens actually computed (extend steps)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    retractions: int = 0
    decode_retractions: int = 0  # retracted after decoding began (resuming re-feeds its newest token)
    recomputed_tokens: int = 0  # tokens a resumed request had computed before and lost to eviction
    finished: Counter[str] = field(default_factory=Counter)  # by finish_reason

    def count_finish(self, reason: str) -> None:
        self.finished[reason] += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "retractions": self.retractions,
            "decode_retractions": self.decode_retractions,
            "recomputed_tokens": self.recomputed_tokens,
            "finished": dict(self.finished),
        }
