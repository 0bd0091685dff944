"""Duels: where two eviction orders disagreed, which of the two leaves was asked for first.

The adaptive policy (candidates.py) evicts by ``last access + class x shift``.
When it evicts leaf v where plain recency (shift 0) or frequency by class
(shift without bound) would have evicted another leaf u of the same depth, it
opens a duel between their places in the tree (ghost keys). Whichever place a
request reaches first settles it: v first means the order that would have kept
v was right, u first means the shifted order was. Unlike counting ghost hits
(ARC), a duel also sees the leaf that was *kept*: a document popular last hour
and idle since never comes back to vote, but the fresh ones evicted in its
place do, so stale counts are unlearned as fast as a new popularity shows.

A duel is direction +1 when v is the more-reused leaf (more shift would have
kept it) and -1 when v is the less-reused one (less shift would have kept it).
Duels come in ``kinds`` (the policy's: the class shift and the depth shift),
each with its own ``capacity`` (the oldest open duel of a kind is dropped
first), and one index over every key of every kind: the policy asks
``key in duels.index`` on every access, one dict lookup however many kinds
are open. ``settle(key)`` closes every duel ``key`` decides and returns the
net vote per kind: +1 for more shift, -1 for less. Keys are any hashables:
the caller names a cached leaf by itself and an evicted one by its ghost key,
and ``rekey`` moves a kept leaf's duels to its ghost key when it is evicted
in turn. Every operation is O(1) per duel touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Duels:
    def __init__(self, capacity: int, kinds: int = 1) -> None:
        self.capacity, self.kinds = capacity, kinds
        # Per kind, oldest first: id -> (victim, kept, direction); an id's kind is id % kinds.
        self._open: list[OrderedDict[int, tuple[Hashable, Hashable, int]]] = [OrderedDict() for _ in range(kinds)]
        self.index: dict[Hashable, set[int]] = {}  # every victim and kept key -> its open duels
        self._next_id = 0

    def __len__(self) -> int:
        return sum(map(len, self._open))

    def open(self, victim: Hashable, kept: Hashable, direction: int, kind: int = 0) -> None:
        """``victim`` was evicted where another order would have evicted ``kept``; ``direction`` +1 or -1."""
        self._next_id += 1
        duel, duels, index = self._next_id * self.kinds + kind, self._open[kind], self.index
        duels[duel] = (victim, kept, direction)
        if (ids := index.get(victim)) is None:
            index[victim] = {duel}
        else:
            ids.add(duel)
        if (ids := index.get(kept)) is None:
            index[kept] = {duel}
        else:
            ids.add(duel)
        if len(duels) > self.capacity:
            self._close(next(iter(duels)))

    def settle(self, key: Hashable) -> list[int]:
        """A request reached ``key``: close the duels it decides; their net vote per kind (+1: more shift)."""
        votes, kinds, index = [0] * self.kinds, self.kinds, self.index
        for duel in index.pop(key, ()):
            victim, kept, direction = self._open[duel % kinds].pop(duel)
            if victim == key:  # the victim came back first: the order that would have kept it was right
                other, vote = kept, direction
            else:
                other, vote = victim, -direction
            votes[duel % kinds] += vote
            if (ids := index.get(other)) is not None:  # None when victim == kept
                ids.discard(duel)
                if not ids:
                    del index[other]
        return votes

    def rekey(self, kept: Hashable, key: Hashable) -> None:
        """The leaf ``kept`` stands for is now known as ``key`` (it was evicted: its ghost key)."""
        ids = self.index.pop(kept, None)
        if ids is None:
            return
        for duel in ids:
            duels = self._open[duel % self.kinds]
            victim, _, direction = duels[duel]
            duels[duel] = (victim, key, direction)
        self.index.setdefault(key, set()).update(ids)

    def _close(self, duel: int) -> tuple[Hashable, int]:
        victim, kept, direction = self._open[duel % self.kinds].pop(duel)
        for key in (victim, kept):
            ids = self.index.get(key)
            if ids is not None:  # victim == kept: one entry for both
                ids.discard(duel)
                if not ids:
                    del self.index[key]
        return victim, direction

    def check(self) -> None:
        assert all(len(duels) <= self.capacity for duels in self._open), "duels over capacity"
        records = {duel: record for duels in self._open for duel, record in duels.items()}
        assert all(duel % self.kinds == kind for kind, duels in enumerate(self._open) for duel in duels)
        expected: dict[Hashable, set[int]] = {}
        for duel, (victim, kept, _) in records.items():
            expected.setdefault(victim, set()).add(duel)
            expected.setdefault(kept, set()).add(duel)
        assert self.index == expected, "duel index drifted"
