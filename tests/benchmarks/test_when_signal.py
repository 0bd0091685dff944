"""``bench when-signal``: the AUC it reports, and a run on the committed Mooncake slice."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.when_signal import auc, measure

SLICE = Path(__file__).parent / "data" / "mooncake_conversation_head200.jsonl"


def test_auc_ranks_positives_over_negatives_ties_half() -> None:
    assert auc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert auc([4, 3, 2, 1], [False, False, True, True]) == 0.0
    assert auc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    assert auc([0.1, 0.9, 0.4], [False, True, True]) == 1.0
    assert math.isnan(auc([1, 2], [True, True]))


def test_measures_every_feature_set_on_a_trace_slice() -> None:
    rows = measure(f"mooncake:{SLICE}", "all", 0.25, every=1, size=8)  # smaller pools: H = 0 in its bursts
    assert rows[0].startswith("mooncake_conversation_head200.jsonl all at 25%") and "samples" in rows[0]
    values = [float(row.split()[-1]) for row in rows[1:]]
    assert len(values) == 6 and all(0.0 <= v <= 1.0 for v in values), rows
