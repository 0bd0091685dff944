"""The online eviction policies (adaptive, learned, minisim, when) against the fixed ones,, from one simulate run.

Per capacity (page size 1), for each online policy in the run: its hit rate, the best fixed policy's (and
which), the difference, how much of the LRU-to-Belady gap adaptive closes, and
its cache CPU per request over LRU's, measured in the same run (same trace,
same capacity, replays side by side). The default rule of issue 16: adaptive
may become the default only if it is never more than 0.5 points under the best
fixed policy at any capacity of any workload; ``meets_default_rule`` says
whether this run keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

DEFAULT_RULE_POINTS = 0.5
ONLINE = ("adaptive", "learned", "minisim", "when")  # policies that learn from the traffic: never "fixed" rivals


class Row(Protocol):
    @property
    def cache(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def capacity_fraction(self) -> float: ...
    @property
    def hit_rate(self) -> float: ...
    @property
    def us_per_request(self) -> float: ...


def _by_capacity(results: Sequence[Row]) -> dict[int, dict[str, Row]]:
    table: dict[int, dict[str, Row]] = {}
    for r in results:
        table.setdefault(r.capacity, {})[r.cache] = r
    return dict(sorted(table.items()))


def _fixed(rows: dict[str, Row]) -> dict[str, Row]:
    online = {f"radix-{policy}-p1" for policy in ONLINE}
    return {
        name: r for name, r in rows.items() if name.startswith("radix-") and name.endswith("-p1") and name not in online
    }


def online_summaries(results: Sequence[Row]) -> str:
    """``adaptive_summary`` for each online policy in the run, one after the other."""
    return "\n".join(text for policy in ONLINE if (text := adaptive_summary(results, policy)))


def adaptive_summary(results: Sequence[Row], policy: str = "adaptive") -> str:
    """The comparison table for ``policy``, or "" when the run has it not or no fixed radix policy at page 1."""
    lines = []
    for rows in _by_capacity(results).values():
        fixed, adaptive, lru = _fixed(rows), rows.get(f"radix-{policy}-p1"), rows.get("radix-lru-p1")
        if adaptive is None or not fixed:
            continue
        best = max(fixed.values(), key=lambda r: r.hit_rate)
        closed = ""
        bound = rows.get("belady")
        if bound is not None and lru is not None and bound.hit_rate > lru.hit_rate:
            closed = f"{(adaptive.hit_rate - lru.hit_rate) / (bound.hit_rate - lru.hit_rate):.0%}"
        cpu = f"{adaptive.us_per_request / lru.us_per_request:.2f}x" if lru is not None else ""
        best_name = best.cache.removeprefix("radix-").removesuffix("-p1")
        lines.append(
            f"{adaptive.capacity_fraction:>8.0%} {adaptive.hit_rate:>9.1%} {best_name:>8} {best.hit_rate:>6.1%} "
            f"{(adaptive.hit_rate - best.hit_rate) * 100:>+8.1f} pt {closed:>16} {cpu:>12}"
        )
    if not lines:
        return ""
    head = f"{'capacity':>8} {policy:>9} {'best fixed':>15} {'vs best':>11} {'LRU-bound closed':>16} "
    head += f"{'CPU vs lru':>12}"
    verdict = "holds" if meets_default_rule(results, policy) else "fails"
    return "\n".join(
        [f"\n{policy} against the fixed policies (page 1; default rule: within {DEFAULT_RULE_POINTS} pt: {verdict})"]
        + [head]
        + lines
    )


def meets_default_rule(results: Sequence[Row], policy: str = "adaptive") -> bool:
    """``policy`` within ``DEFAULT_RULE_POINTS`` of the best fixed policy at every capacity of this run."""
    for rows in _by_capacity(results).values():
        fixed, adaptive = _fixed(rows), rows.get(f"radix-{policy}-p1")
        if adaptive is not None and fixed:
            if max(r.hit_rate for r in fixed.values()) - adaptive.hit_rate > DEFAULT_RULE_POINTS / 100:
                return False
    return True
