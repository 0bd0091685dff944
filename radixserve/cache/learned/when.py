"""The ``when`` eviction candidate set: evict the leaf least likely to be read again within the cache's horizon.

Belady wins by knowing *when* a prefix is read next, not only whether: at 5-10% of a production working set the
pool holds about a minute of traffic while a conversation's next turn is minutes away. This set predicts, for
each leaf, P(read again within H | its class, its age), where

- H, the horizon, is how long the pool's contents last at this capacity, measured online: the time it took to
  evict the last pool's worth of tokens (``horizon``);
- a leaf's class is what the tree knows of it: reused 0, 1, 2-3, 4-7 or 8+ times, at the top level or below a
  cached prefix (ten classes; ``leaf_class``);
- its age is the time since its last access, on the tree's clock (a replay's trace timestamps).

Each class learns the distribution of its leaves' reuse gaps online: an access to a candidate leaf is a gap from its
previous access; an eviction counts as never read again, and leaves a ghost where the leaf hung: a lookup that stops
at the ghost (``note_miss``, within ``GHOST_REACH`` pools' worth of later evictions) turns that never into the gap
it would have had. (Counting evicted leaves only when read back left the curves blind to the leaves never read
again: 3.5-10.5 points lost at 25% on the held-out traces.) Gaps fall in log-spaced bins
(``BINS_PER_OCTAVE`` a factor of two); a class's survival S(x) = the share of its gaps longer than x (never
included), linear in log x inside a bin, and P(read within H | age a) = (S(a) - S(a + H)) / S(a) (``SCORE``,
``HORIZON_SCALE``: tuned). ``_retable`` tabulates that per class and age bin when H moved by ``RETABLE_MOVE`` or
``RETABLE_EVERY`` gaps came in; a class's counts halve once they pass ``MAX_COUNT`` (recent traffic weighs most); a
small prior (``PRIOR``) spread over the bins makes a class without data rank like LRU (the probability falls with
age).

The order within a class is not recency: with a turn gap longer than H, a leaf near its typical gap is likelier
to be read soon than one just written. Where the probability rises then falls with age (one typical gap), its
minimum over a class's leaves is at the youngest or the oldest: a pop compares those two of each class (one
ascending and one descending heap per class, by last access) and evicts the lowest probability, the older on a
tie. Without a horizon yet (less than a pool evicted), the oldest leaf of all goes (LRU).

Deterministic given the trace (no randomness; only the tree's clock, access times, hit counts and depths), and
bounded: per member its class and interval start; per class ``NUM_BINS`` + 1 counts and a table; ghosts at most
``GHOST_REACH`` pools of tokens; the horizon's window at most one pool of evictions. Cost: a pop reads at most
twenty heap heads (O(classes + log n) per evicted leaf), an access to a candidate re-files it (O(log n)).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import numpy as np

from radixserve.cache.core.candidates import CandidateHeap, Ranked

T = TypeVar("T", bound=Ranked)

HIT_CLASSES = 5  # reused 0, 1, 2-3, 4-7, ... times: this many buckets, the last open-ended
NUM_CLASSES = 2 * HIT_CLASSES


def leaf_class(node: Ranked) -> int:
    """Reused 0, 1, 2-3, ... times (the hit count's bit length, capped; x 2), at the top level (+0) or below a
    cached prefix (+1)."""
    return min(node.hit_count.bit_length(), HIT_CLASSES - 1) * 2 + (node.depth > 0)


def _oldest(node: Ranked) -> tuple[float]:
    return (node.last_access_time,)


def _youngest(node: Ranked) -> tuple[float]:
    return (-node.last_access_time,)


class WhenCandidates(Generic[T]):
    """Unlocked leaves for the ``when`` policy: ``CandidateHeap``'s interface plus the learned reuse gaps."""

    MIN_LOG2, MAX_LOG2 = -6, 22  # gaps below 2**-6 fall in the first bin, above 2**22 in the last finite one
    BINS_PER_OCTAVE = 2
    NUM_BINS = (MAX_LOG2 - MIN_LOG2) * BINS_PER_OCTAVE  # finite bins; index NUM_BINS counts "never"
    PRIOR = 1.0  # pseudo-gaps per class, spread evenly over the finite bins and never
    MAX_COUNT = 4000.0  # a class's gaps halve past this: a window of recent traffic
    GHOST_REACH = 4.0  # ghosts hold this many pools' worth of tokens (the oldest forgotten: never read)
    HORIZON_SCALE = 1.0  # the window W a score looks ahead: this many horizons
    SCORE = "horizon"  # or "density" (``_retable``)
    STEPS = 16  # points per window in ``_retable``
    YOUNG_END = True  # compare each class's youngest leaf too (False: the oldest only)
    RETABLE_MOVE = 0.05  # retabulate when H moved by this share ...
    RETABLE_EVERY = 64  # ... or this many gaps came in

    def __init__(
        self,
        tie_break: Callable[[T], int],
        ghost_key: Callable[[T], Hashable],
        size: Callable[[T], int],
        capacity_len: int,
    ) -> None:
        self._tie_break, self._ghost_key, self._size = tie_break, ghost_key, size
        self.now = -math.inf  # the latest time the tree passed in (a lookup, an insert): pops read no clock
        self._old: list[CandidateHeap[T]] = [CandidateHeap(_oldest, tie_break, True) for _ in range(NUM_CLASSES)]
        self._young: list[CandidateHeap[T]] = [CandidateHeap(_youngest, tie_break, False) for _ in range(NUM_CLASSES)]
        self._member: dict[T, tuple[int, float]] = {}  # member -> (class, start of its current gap)
        self.capacity_len = max(capacity_len, 1)
        prior = self.PRIOR / (self.NUM_BINS + 1)
        self.counts = np.full((NUM_CLASSES, self.NUM_BINS + 1), prior)  # gaps per class and bin; last: never
        self._ghosts: OrderedDict[Hashable, tuple[int, float, int]] = OrderedDict()  # key -> class, start, tokens
        self.ghost_len = 0
        self.evictions: deque[tuple[float, int]] = deque()  # (time, tokens): the last pool's worth evicted
        self._evicted_len = 0
        self.table = np.zeros((NUM_CLASSES, self.NUM_BINS))  # P(read within H | class, age bin)
        self._table_horizon = math.nan
        self._pending = 0  # gaps since the last retable
        self.frozen = False  # True: the table stays as it is (tests that hold the order to a brute force)

    def __len__(self) -> int:
        return len(self._member)

    def __contains__(self, member: T) -> bool:
        return member in self._member

    def __iter__(self) -> Iterator[T]:
        return iter(self._member)

    # ---- membership ---------------------------------------------------------------------------

    def add(self, member: T) -> None:
        """Make ``member`` a candidate, or re-file it (a split changed its depth); its gap runs from its last
        access, or on from where it ran when re-filed."""
        entry = self._member.get(member)
        start = member.last_access_time if entry is None else entry[1]
        self.discard(member)
        cls = leaf_class(member)
        self._member[member] = (cls, start)
        self._old[cls].add(member)
        self._young[cls].add(member)

    def discard(self, member: T) -> None:
        entry = self._member.pop(member, None)
        if entry is not None:
            self._old[entry[0]].discard(member)
            self._young[entry[0]].discard(member)

    def refresh(self, member: T) -> None:
        """An access: a candidate's gap ends here (one observation), a new one starts."""
        entry = self._member.get(member)
        if entry is None:
            return
        now = member.last_access_time
        if now > entry[1]:
            self._observe(entry[0], now - entry[1])
        self.discard(member)
        self.add(member)

    # ---- eviction -----------------------------------------------------------------------------

    def pop(self) -> T | None:
        """The least likely to be read within the horizon of each class's youngest and oldest leaf."""
        now = self.now
        horizon = self.horizon(now)
        if horizon is not None and not self.frozen:  # the first horizon moved too: the table's is nan
            if not abs(horizon - self._table_horizon) <= self.RETABLE_MOVE * self._table_horizon:
                self._retable(horizon)
        best: tuple[float, float, int] | None = None
        chosen: tuple[T, int] | None = None
        for cls in range(NUM_CLASSES):
            for heap in (self._old[cls], self._young[cls]) if self.YOUNG_END else (self._old[cls],):
                member = heap.peek()
                if member is None:
                    break
                p = 0.0 if horizon is None else float(self.table[cls, self._bin(now - member.last_access_time)])
                key = (p, member.last_access_time, self._tie_break(member))
                if best is None or key < best:
                    best, chosen = key, (member, cls)
        if chosen is None:
            return None
        member, cls = chosen
        start = self._member[member][1]
        self.discard(member)
        length = self._size(member)
        self._remember(self._ghost_key(member), cls, start, length)
        self.evictions.append((now, length))
        self._evicted_len += length
        while self._evicted_len - self.evictions[0][1] >= self.capacity_len:
            self._evicted_len -= self.evictions.popleft()[1]
        return member

    def horizon(self, now: float) -> float | None:
        """How long the pool's contents last: the time the last pool's worth of evictions took (None until a
        pool's worth was evicted)."""
        if self._evicted_len < self.capacity_len:
            return None
        return max(now - self.evictions[0][0], 1e-9)

    # ---- learning -----------------------------------------------------------------------------

    def note_lookup(self, key: object, now: float) -> None:
        """A lookup: only its time is read (the clock of the next pops)."""
        self.now = max(self.now, now)

    def note_finished(self, key: object, now: float) -> None:
        """A finished request's insert: only its time is read."""
        self.now = max(self.now, now)

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where an evicted leaf hung: the gap it would have had."""
        self.now = max(self.now, now)
        ghost = self._ghosts.pop(ghost_key, None)
        if ghost is not None:
            self.ghost_len -= ghost[2]
            row = self.counts[ghost[0]]  # its eviction counted it as never read again: it was, after all
            row[self.NUM_BINS] = max(row[self.NUM_BINS] - 1.0, 0.0)
            self._observe(ghost[0], max(now - ghost[1], 0.0))

    def _remember(self, key: Hashable, cls: int, start: float, length: int) -> None:
        old = self._ghosts.pop(key, None)
        if old is not None:
            self.ghost_len -= old[2]
        self._ghosts[key] = (cls, start, length)
        self.ghost_len += length
        self._observe(cls, math.inf)  # never read again, until its ghost is (``note_miss`` moves it to its gap)
        while self.ghost_len > self.GHOST_REACH * self.capacity_len and len(self._ghosts) > 1:
            self.ghost_len -= self._ghosts.popitem(last=False)[1][2]

    def _observe(self, cls: int, gap: float) -> None:
        row = self.counts[cls]
        row[self.NUM_BINS if math.isinf(gap) else self._bin(gap)] += 1.0
        if row.sum() > self.MAX_COUNT:
            row *= 0.5
        self._pending += 1
        if self._pending >= self.RETABLE_EVERY and not self.frozen and not math.isnan(self._table_horizon):
            self._retable(self._table_horizon)

    def _bin(self, gap: float) -> int:
        if gap <= 0.0:
            return 0
        k = int((math.log2(gap) - self.MIN_LOG2) * self.BINS_PER_OCTAVE)
        return min(max(k, 0), self.NUM_BINS - 1)

    def _retable(self, horizon: float) -> None:
        """Each class's score at each age bin's middle a, from its survival curve S over the window [a, a + W],
        W = ``HORIZON_SCALE`` x H: ``"horizon"``: P(read within W | age a) = (S(a) - S(a + W)) / S(a);
        ``"density"`` (LHD's hit density): those reads per unit of time the leaf would hold its slots,
        (S(a) - S(a + W)) / the integral of S over the window."""
        self._table_horizon, self._pending = horizon, 0
        edges = np.arange(self.NUM_BINS + 1, dtype=np.float64)  # bin boundaries, in bins from 2**MIN_LOG2
        ages = np.exp2((edges[:-1] + 0.5) / self.BINS_PER_OCTAVE + self.MIN_LOG2)
        times = ages[:, None] + self.HORIZON_SCALE * horizon * np.linspace(0.0, 1.0, self.STEPS + 1)[None, :]
        points = np.clip((np.log2(times) - self.MIN_LOG2) * self.BINS_PER_OCTAVE, 0.0, float(self.NUM_BINS))
        for cls in range(NUM_CLASSES):
            tail = np.cumsum(self.counts[cls][::-1])[::-1]  # tail[k]: gaps in bin k or later (never included)
            survive = np.interp(points, edges, tail)
            read = survive[:, 0] - survive[:, -1]
            if self.SCORE == "density":
                self.table[cls] = read / (survive[:, :-1] + survive[:, 1:]).sum(axis=1)  # x 2 STEPS / W: a constant
            else:
                self.table[cls] = read / survive[:, 0]

    def check(self) -> None:
        for cls in range(NUM_CLASSES):
            self._old[cls].check()
            self._young[cls].check()
            members = {m for m, (c, _) in self._member.items() if c == cls}
            assert set(self._old[cls]) == members == set(self._young[cls]), "a member in the wrong class"
        assert all(leaf_class(m) == c for m, (c, _) in self._member.items()), "a member filed under a stale class"
        assert self.ghost_len == sum(g[2] for g in self._ghosts.values()), "ghost tokens drifted"
        assert self.ghost_len <= self.GHOST_REACH * self.capacity_len or len(self._ghosts) == 1, "ghosts unbounded"
        assert self._evicted_len == sum(n for _, n in self.evictions), "horizon window drifted"
        assert float(self.counts.sum(axis=1).max()) <= self.MAX_COUNT + 1.0, "gap counts unbounded"
