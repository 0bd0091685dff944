"""The adaptive-vs-fixed summary of ``bench simulate``: the default rule and the figures it prints."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.policy_table import adaptive_summary, meets_default_rule, online_summaries


@dataclass
class Row:
    cache: str
    capacity: int
    hit_rate: float
    us_per_request: float = 10.0
    capacity_fraction: float = 0.25


def rows(adaptive: float, lru: float = 0.70, lfu: float = 0.75, bound: float = 0.80) -> list[Row]:
    return [
        Row("radix-lru-p1", 100, lru),
        Row("radix-lfu-p1", 100, lfu),
        Row("radix-adaptive-p1", 100, adaptive, us_per_request=12.0),
        Row("radix-lfu-p16", 100, 0.99),  # page 16 is not a rival at page 1
        Row("belady", 100, bound),
    ]


def test_default_rule_allows_half_a_point_under_the_best_fixed_policy() -> None:
    assert meets_default_rule(rows(0.746))
    assert not meets_default_rule(rows(0.744))
    assert not meets_default_rule(rows(0.80) + [Row("radix-adaptive-p1", 200, 0.5), Row("radix-lru-p1", 200, 0.6)])


def test_summary_names_the_best_policy_gap_closed_and_cpu_ratio() -> None:
    text = adaptive_summary(rows(0.76))
    line = text.splitlines()[-1].split()
    assert line == ["25%", "76.0%", "lfu", "75.0%", "+1.0", "pt", "60%", "1.20x"]
    assert "default rule: within 0.5 pt: holds" in text
    assert adaptive_summary([Row("radix-lru-p1", 100, 0.7)]) == ""


def test_every_online_policy_gets_its_summary_and_is_no_fixed_rival() -> None:
    results = rows(0.76) + [Row("radix-learned-p1", 100, 0.80, us_per_request=15.0)]
    text = online_summaries(results)
    assert "adaptive against the fixed policies" in text and "learned against the fixed policies" in text
    learned_line = text.splitlines()[-1].split()
    assert learned_line == ["25%", "80.0%", "lfu", "75.0%", "+5.0", "pt", "100%", "1.50x"]
    assert meets_default_rule(results)  # learned at 80% is not a fixed rival adaptive must match
