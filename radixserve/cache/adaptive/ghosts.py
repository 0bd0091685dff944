"""Ghosts: what the adaptive policy (candidates.py) remembers of the leaves it evicted, ARC-style.

Every evicted leaf leaves a ghost (its group, eviction time, length and hit
count) under its place in the tree (parent id, first page): the key a later
lookup that stops there passes to ``note_miss``. Ghosts hold at most
``capacity_len`` tokens (the pool's size), oldest forgotten first, so the age
of the oldest ghost is the cache's turnover: the ``horizon`` the adaptive
policy counts every learned shift in. Each operation is O(1).

Frequency outlives eviction: the node a missed ghost's request inserts at the
ghost's place starts with the ghost's hit count instead of 0 (the "perfect
LFU" of the literature, which beats in-cache counts on Zipf popularity): a
popular document evicted in a burst of other traffic is protected again as
soon as it is back, instead of having to earn its reuses anew. The restored
count is the node's ``hit_count`` (a radix split copies it to both halves).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import NamedTuple


class Ghost(NamedTuple):
    group: int  # 0: the top level (nothing cached above it), 1: below it
    evicted_at: float
    length: int  # tokens
    hit_count: int


_new_ghost = tuple.__new__  # a NamedTuple's generated __new__ is Python code; tuple's builds the same object


class Ghosts:
    def __init__(self, capacity_len: int) -> None:
        self.capacity_len = capacity_len
        self._ghosts: OrderedDict[Hashable, Ghost] = OrderedDict()  # oldest first
        self.total_len = 0
        self.group_len = [0, 0]  # ghost tokens of the top level, of below it

    def __len__(self) -> int:
        return len(self._ghosts)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ghosts

    def remember(self, key: Hashable, group: int, evicted_at: float, length: int, hit_count: int) -> None:
        """A leaf was evicted from ``key``'s place; the oldest ghosts go while over capacity (never the newest)."""
        ghosts = self._ghosts
        if key in ghosts:
            self._drop(ghosts.pop(key))
        ghosts[key] = _new_ghost(Ghost, (group, evicted_at, length, hit_count))  # once per eviction: skip __new__
        self.total_len += length
        self.group_len[group] += length
        while self.total_len > self.capacity_len and len(ghosts) > 1:
            oldest = ghosts.popitem(last=False)[1]
            self.total_len -= oldest.length
            self.group_len[oldest.group] -= oldest.length

    def take(self, key: Hashable) -> tuple[Ghost, float] | None:
        """Forget the ghost at ``key`` (a lookup stopped there); it and its share of its group's ghost tokens."""
        ghost = self._ghosts.pop(key, None)
        if ghost is None:
            return None
        share = ghost.length / max(self.group_len[ghost.group], 1)
        self.total_len -= ghost.length
        self.group_len[ghost.group] -= ghost.length
        return ghost, share

    def horizon(self, now: float, fallback: float) -> float:
        """How long ago the oldest remembered ghost was evicted (``fallback`` when none is left)."""
        oldest = next(iter(self._ghosts.values())).evicted_at if self._ghosts else fallback
        return now - oldest if now > oldest else 0.0

    def check(self) -> None:
        ghosts = self._ghosts.values()
        assert self.total_len == sum(g.length for g in ghosts), "ghost token count drifted"
        assert self.group_len[0] == sum(g.length for g in ghosts if g.group == 0), "top ghosts drifted"
        assert self.total_len <= self.capacity_len or len(self._ghosts) == 1, "ghosts over capacity"

    def _drop(self, ghost: Ghost | None) -> None:
        if ghost is not None:
            self.total_len -= ghost.length
            self.group_len[ghost.group] -= ghost.length
