"""Duels: where two eviction orders disagreed, which of the two leaves was asked for first.

The adaptive policy (adaptive.py) evicts by ``last access + class x shift``.
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
``settle(key)`` returns the net vote of every duel ``key`` settles: +1 for
more shift, -1 for less. Keys are any hashables: the caller names a cached
leaf by itself and an evicted one by its ghost key, and ``rekey`` moves a
kept leaf's duels to its ghost key when it is evicted in turn. Memory is bounded: the oldest open duel is dropped
first. Every operation is O(1) per duel touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Duels:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._open: OrderedDict[int, tuple[Hashable, Hashable, int]] = OrderedDict()  # id -> (victim, kept, dir)
        self._by_victim: dict[Hashable, set[int]] = {}
        self._by_kept: dict[Hashable, set[int]] = {}
        self._next_id = 0
        self.pending = 0  # open duels; a plain attribute: the policy checks it on every access

    def __len__(self) -> int:
        return len(self._open)

    def open(self, victim: Hashable, kept: Hashable, direction: int) -> None:
        """``victim`` was evicted where another order would have evicted ``kept``; ``direction`` +1 or -1."""
        self._next_id += 1
        self._open[self._next_id] = (victim, kept, direction)
        self._by_victim.setdefault(victim, set()).add(self._next_id)
        self._by_kept.setdefault(kept, set()).add(self._next_id)
        self.pending += 1
        if len(self._open) > self.capacity:
            self._close(next(iter(self._open)))

    def settle(self, key: Hashable) -> int:
        """A request reached ``key``: close the duels it decides; their net vote (+1: more shift)."""
        vote = 0
        if (ids := self._by_victim.get(key)) is not None:
            for duel in list(ids):
                vote += self._close(duel)
        if (ids := self._by_kept.get(key)) is not None:
            for duel in list(ids):
                vote -= self._close(duel)
        return vote

    def rekey(self, kept: Hashable, key: Hashable) -> None:
        """The leaf ``kept`` stands for is now known as ``key`` (it was evicted: its ghost key)."""
        ids = self._by_kept.pop(kept, None)
        if ids is None:
            return
        for duel in ids:
            victim, _, direction = self._open[duel]
            self._open[duel] = (victim, key, direction)
        self._by_kept.setdefault(key, set()).update(ids)

    def _close(self, duel: int) -> int:
        victim, kept, direction = self._open.pop(duel)
        self.pending -= 1
        for index, key in ((self._by_victim, victim), (self._by_kept, kept)):
            ids = index[key]
            ids.discard(duel)
            if not ids:
                del index[key]
        return direction

    def check(self) -> None:
        assert len(self._open) <= self.capacity and self.pending == len(self._open), "duels over capacity"
        for index, role in ((self._by_victim, 0), (self._by_kept, 1)):
            assert sum(len(ids) for ids in index.values()) == len(self._open), "duel index drifted"
            assert all(self._open[d][role] == key for key, ids in index.items() for d in ids), "duel index drifted"
