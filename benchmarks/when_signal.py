"""``radixserve bench when-signal``: how well the tree's features predict that a leaf is read again *soon*.

Issue 36's *when* question, measured before a policy is built on it. An LRU replay of a trace (its timestamps
as the clock, page 1, concurrency 16); at every ``--every``-th eviction ``--sample`` candidate leaves are drawn
(a seeded draw) and labelled by whether the trace reads them again within the horizon H (the median age at
eviction of the last 64 LRU victims). A lookup table of P(label | age bin x feature bins) is fit on the first
half of the samples (by time) and scored on the second: AUC, the chance that a leaf read within H ranks above
one that is not (0.5: no signal). Rows: age alone as LRU ranks it, the table over age with each feature set,
and an oracle that knows whether the leaf is ever read again (the future index of belady.py).
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.belady import FutureIndex
from benchmarks.simulate import read_trace, replay
from benchmarks.traces import working_set_tokens
from radixserve.cache.core.candidates import CandidateHeap, CandidateSet
from radixserve.cache.core.policy import CandidateHooks, LRUStrategy
from radixserve.cache.core.radix import RadixCache, TreeNode
from radixserve.memory import TokenAllocator


@dataclass
class Sample:
    eviction: int
    request: int
    now: float
    horizon: float
    age: float
    hits: int
    depth: int
    own_gap: float  # between the leaf's last two accesses (nan: one access)
    turn_gap: float  # between the leaf's creation and its parent's (nan: at the top level)
    path: np.ndarray
    namespace: str | None
    label: bool = False
    ever: bool = False


class SamplingHeap(CandidateHeap[TreeNode]):
    """LRU's heap, sampling the candidates at evictions."""

    def __init__(self, rank: Callable[[TreeNode], tuple[float, ...]], tie_break: Callable[[TreeNode], int]) -> None:
        super().__init__(rank, tie_break, True)
        self.previous: dict[TreeNode, tuple[float, float]] = {}  # node -> (previous access, last access)
        self.ages: deque[float] = deque(maxlen=64)
        self.rng = random.Random(0)
        self.samples: list[Sample] = []
        self.cache: RadixCache | None = None
        self.clock: list[float] = [0, 0]  # the replay's: [request index, time]
        self.every, self.size, self.evictions = 5, 32, 0

    def refresh(self, member: TreeNode) -> None:
        last = self.previous.get(member, (math.nan, member.creation_time))[1]
        if member.last_access_time != last:
            self.previous[member] = (last, member.last_access_time)
        super().refresh(member)

    def pop(self) -> TreeNode | None:
        assert self.cache is not None
        now = self.cache.clock()
        self.evictions += 1
        if self.evictions % self.every == 0 and len(self.ages) >= 16:
            members = sorted(self, key=lambda n: n.id)
            horizon = max(float(np.median(self.ages)), 1e-9)  # a burst at one timestamp: ages of 0
            self.samples += [
                self._sample(n, now, horizon) for n in self.rng.sample(members, min(self.size, len(members)))
            ]
        victim = super().pop()
        if victim is not None:
            self.ages.append(now - victim.last_access_time)
        return victim

    def _sample(self, node: TreeNode, now: float, horizon: float) -> Sample:
        assert self.cache is not None and node.parent is not None
        previous, last = self.previous.get(node, (math.nan, node.creation_time))
        top = node.parent is self.cache.root
        turn_gap = math.nan if top else node.creation_time - node.parent.creation_time
        path = self.cache.path_key(node).token_ids[: node.depth + 1].copy()
        return Sample(self.evictions, int(self.clock[0]), now, horizon, now - node.last_access_time, node.hit_count,
                      node.depth, last - previous, turn_gap, path, node.key.extra_key)  # fmt: skip


class SamplingLRU(LRUStrategy):
    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return SamplingHeap(self.rank, tie_break)


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(a positive's score > a negative's), ties counted half (Mann-Whitney)."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    for value in np.unique(s):  # ties share their mean rank
        ranks[s == value] = ranks[s == value].mean()
    positives, negatives = int(y.sum()), int((~y).sum())
    if not positives or not negatives:
        return math.nan
    return float((ranks[y].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def _octave(x: float, low: int = -6, high: int = 4) -> int:
    return 99 if math.isnan(x) else low if x <= 0 else min(max(math.floor(math.log2(x)), low), high)


FEATURES: dict[str, Callable[[Sample], tuple[Hashable, ...]]] = {
    "age x hits x top level": lambda s: (min(s.hits, 3), s.depth == 0),
    "age x hits x depth": lambda s: (min(s.hits, 3), _octave(s.depth / 32, 0, 12)),
    "age x hits x own gap": lambda s: (min(s.hits, 3), _octave(s.own_gap / s.horizon)),
    "age x hits x turn gap": lambda s: (min(s.hits, 3), _octave(s.turn_gap / s.horizon)),
}


def table_auc(
    train: Sequence[Sample], test: Sequence[Sample], feature: Callable[[Sample], tuple[Hashable, ...]]
) -> float:
    """AUC on ``test`` of P(label | age bin x ``feature``) counted on ``train``, backing off to age alone."""
    fine: dict[Hashable, list[int]] = {}
    coarse: dict[Hashable, list[int]] = {}
    for s in train:
        age = _octave(s.age / s.horizon)
        for table, cell in ((fine, (age, *feature(s))), (coarse, age)):
            table.setdefault(cell, [0, 0])[0] += s.label
            table[cell][1] += 1
    prior = sum(s.label for s in train) / max(len(train), 1)

    def predict(s: Sample) -> float:
        age = _octave(s.age / s.horizon)
        for counts in (fine.get((age, *feature(s))), coarse.get(age)):
            if counts and counts[1] >= 20:
                return (counts[0] + prior) / (counts[1] + 1)
        return prior

    return auc([predict(s) for s in test], [s.label for s in test])


def measure(spec: str, part: str, fraction: float, every: int = 5, size: int = 32) -> list[str]:
    """The table's rows for one trace half at ``fraction`` of its working set."""
    requests = read_trace(spec, 512, 32, None, part)
    capacity = int(fraction * working_set_tokens(requests))
    heaps: list[SamplingHeap] = []

    def factory(clock: list[float]) -> RadixCache:
        cache = RadixCache(TokenAllocator(capacity), 1, SamplingLRU(), clock=lambda: float(clock[1]))
        heap = cache.candidates
        assert isinstance(heap, SamplingHeap)
        heap.cache, heap.clock, heap.every, heap.size = cache, clock, every, size
        heaps.append(heap)
        return cache

    replay(requests, "lru-sampled", capacity, trace_clock=True, factory=factory)
    samples = heaps[0].samples
    index = FutureIndex([(r.extra_key, r.prompt) for r in requests])
    times = [r.timestamp or 0.0 for r in requests]
    for s in samples:
        next_use, _ = index.next_use(s.namespace, s.path, s.request)
        s.ever = not math.isinf(next_use)
        s.label = s.ever and times[int(next_use)] - s.now <= s.horizon
    train, test = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    labels = [s.label for s in test]
    rows = [
        f"{spec.split('/')[-1]} {part} at {fraction:.0%}: {len(samples):,} samples, H median "
        f"{np.median([s.horizon for s in samples]):.1f} s, read within H {np.mean([s.label for s in samples]):.1%}, "
        f"ever read again {np.mean([s.ever for s in samples]):.1%}",
        f"  AUC age (LRU's order)              {auc([-s.age for s in test], labels):.3f}",
    ]
    rows += [f"  AUC table {name:<25} {table_auc(train, test, f):.3f}" for name, f in FEATURES.items()]
    oracle = [float(s.ever) * 1e9 - s.age for s in test]
    rows.append(f"  AUC oracle: ever read again, then age {auc(oracle, labels):.3f}")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench when-signal", description=__doc__)
    parser.add_argument("--traces", required=True, help="comma-separated mooncake:PATH (or PATH) traces")
    parser.add_argument("--time-slice", default="first-half", choices=("all", "first-half", "second-half"))
    parser.add_argument("--fractions", default="0.05", help="capacities: shares of the working set")
    parser.add_argument("--every", type=int, default=5, help="sample at every this many evictions")
    parser.add_argument("--sample", type=int, default=32, help="candidate leaves drawn per sampled eviction")
    args = parser.parse_args(argv)
    for spec in (s for s in args.traces.split(",") if s):
        for fraction in (float(f) for f in args.fractions.split(",")):
            print("\n".join(measure(spec, args.time_slice, fraction, args.every, args.sample)), flush=True)
