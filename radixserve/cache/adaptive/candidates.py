"""The adaptive eviction candidate set: depth, recency and frequency, how much each weighs learned online.

A leaf's depth is the number of tokens above its first token. Below the top
level (depth > 0, under a cached prefix) the deepest leaf goes first, unless
the oldest leaf there is older by more than a learned ``depth_shift``. A deep
leaf is the most specific content there is: the newest turn of one
conversation, a question asked once below a shared document, a leaf step of
one thought tree. A shallow one is what many later requests start with (a
document, a thought tree's middle step). In the replays of ``bench simulate``
this order is most of the gain over LRU on tree-of-thought traces and grouped
prompts (BENCHMARKS §2). But deepest first alone never lets an idle shallow
leaf go while anything deeper is cached: a finished conversation's last turn
outlived the newest turns of the active ones, and cost up to 0.8 points
against LRU on multi-turn chat. Among leaves of one depth (siblings,
documents below one system prompt) recency or frequency decides:

Leaves fall into classes by how often finished requests reused them: class 0
never (seen once), class c >= 1 about 2**(c-1) times (log2 buckets, capped).
Each class is an LRU heap (class_heaps.py) ordered by (-depth, last access),
one set of them for the top level and one below it. The best leaf of a group
is its smallest ``(-depth, last_access_time + c * shift)``: a reused leaf
survives ``shift`` clock units longer per class than a cold one of the same
depth (``shift == 0``: LRU within a depth; large: LFU over log2 buckets).

Top-level leaves (nothing cached above them) are the roots of whatever comes:
a thought tree's root, a group's system prompt, but also a one-off prompt that
shares nothing. Depth cannot tell those apart, so the two groups' best are
compared by recency: the top level's is evicted when its shifted access time
plus ``top_shift`` is below the deepest leaf's. ``top_shift`` is learned from
ghosts (below): a ghost hit on a top-level leaf grows it (roots come back:
keep them longer), one below shrinks it (the deep-first order erred), up to 16
horizons. One-off prompts beside conversations drive it to 0 (plain recency
across the groups); thought trees drive it up.

The shift is learned from duels (duels.py): when the shifted order evicts a
leaf where plain recency (shift 0) or frequency by class (no bound) would
have evicted another leaf of the same depth, whichever of the two places a
request reaches first votes for the order that would have kept it. Each vote
multiplies the shift, counted in ghost horizons (how long ago the oldest
remembered ghost was evicted: this cache's turnover, in the tree's clock
units), by 2**``learning_rate`` up or down, within [1/64, 16] horizons; at
the floor it is 0 (LRU within a depth). It starts at one horizon. A duel sees
the leaf that was kept, which ghost hits never do: stale counts (a popularity
that moved on) are unlearned as soon as the fresh leaves evicted in their
place come back first. (Ghost hits alone, ARC's signal, could not tell a
shift in popularity from noise: on ``rag-shift`` at seeds 1 and 2 they
stayed 1.5-2.2 points under LRU; BENCHMARKS §2.)

``depth_shift`` is learned from duels the same way: when the deepest leaf is
evicted where shifted recency across depths would have evicted an older,
shallower one, or the other way round, the two duel; each vote scales it by
2**``learning_rate`` within [1/64, 16] horizons (0 at the floor: shifted
recency alone below the top level). It is infinite (deepest first) until the
first vote. In the replays (seed 0, 25% of the working set) it settles at
3-5 horizons on chat, RAG and thought trees (BENCHMARKS §2). The deepest and
the least recent leaf come from one heap per class ordered by (-depth, last
access) and one recency heap for every leaf below the top level.

Ghosts (ghosts.py): a lookup that stops exactly where an evicted leaf's
ghost would have continued moves ``top_shift`` by ``TOP_LEARNING_RATE`` x
the horizon x the ghost's share of its group's ghost tokens (ARC's ratio),
within [0, 16 horizons], and the node its request inserts there starts with
the ghost's hit count (frequency outlives eviction: ghosts.py says why).

Costs: the heaps (class_heaps.py) make ``add``/``refresh`` O(log n) at
worst and an access that changes no class O(1); a pop reads
``2 * num_classes + 1`` cached heads (re-reading only those that changed),
pops one heap and opens at most three duels: evicting k leaves stays
O(k log n). ``note_miss``, and ``refresh`` of a leaf, are one dict lookup
each in the duels' index (plus the duels they settle). The tree keeps each
node's depth (O(1) per insert or split; a split leaf is re-added at its new
depth).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic

from radixserve.cache.adaptive.class_heaps import ClassHeaps, T, group_bests, hit_class
from radixserve.cache.adaptive.duels import Duels
from radixserve.cache.adaptive.ghosts import Ghosts

__all__ = ["AdaptiveCandidates", "hit_class"]

CLASS, DEPTH = 0, 1  # the two kinds of duels: for the class shift, for the depth shift


class AdaptiveCandidates(Generic[T]):
    """Unlocked leaves for the ``adaptive`` policy; the interface of ``CandidateHeap`` plus the learned shifts."""

    MIN_SHIFT, MAX_SHIFT = 1 / 64, 16.0  # horizons; at the floor the shift is 0 (LRU within a depth)
    MAX_TOP_SHIFT = 16.0  # horizons: tree roots are reused across long gaps (thought trees)
    TOP_LEARNING_RATE = 10.0  # top-level ghosts are few and far between: each must move the top shift further
    MAX_REVIVED = 1024  # missed ghosts awaiting their node's return (about one per request in flight)
    INITIAL_DEPTH_SHIFT = 1.0
    MAX_DUELS = 4096  # open duels of each kind (two per eviction at most); the oldest are dropped undecided

    def __init__(
        self,
        tie_break: Callable[[T], int],
        ghost_key: Callable[[T], Hashable],
        size: Callable[[T], int],
        clock: Callable[[], float],
        ghost_capacity_len: int,
        num_classes: int = 3,
        learning_rate: float = 0.25,
        depth_learning: bool = True,
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self._heaps: ClassHeaps[T] = ClassHeaps(num_classes, tie_break, depth_learning)
        self._slot = self._heaps.slot  # member -> its class heap: group * num_classes + class
        self._ghost_key, self._size, self._clock = ghost_key, size, clock
        self._ghosts = Ghosts(ghost_capacity_len)
        self._revived: OrderedDict[Hashable, int] = OrderedDict()  # a missed ghost's hit count, until re-inserted
        self.num_classes, self.learning_rate = num_classes, learning_rate
        self._duels = Duels(self.MAX_DUELS, kinds=2)
        self._dueling = self._duels.index  # every key in an open duel: looked up on every access
        self.shift_horizons = 1.0  # the shift in ghost horizons, learned from duels
        self.shift = 0.0  # clock units a leaf outlives one a class below it (shift_horizons x the horizon)
        self.top_shift = 0.0  # clock units a top-level leaf outlives the deepest leaf below
        self.depth_learning = depth_learning
        self.depth_shift_horizons = self.INITIAL_DEPTH_SHIFT
        self.depth_shift = math.inf  # clock units the deepest leaf below outlives an older, shallower one

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, member: T) -> bool:
        return member in self._slot

    def __iter__(self) -> Iterator[T]:
        return iter(self._slot)

    def class_of(self, member: T) -> int:
        return hit_class(member.hit_count, self.num_classes)

    def slot_of(self, member: T) -> int:
        return self._heaps.slot_of(member)

    def add(self, member: T) -> None:
        if self._revived and not member.hit_count:  # back where a missed ghost was: its count goes on
            member.hit_count = self._revived.pop(self._ghost_key(member), 0)
        if member in self._slot and member in self._dueling:  # re-added: an access
            self._settle(member, None)
        self._heaps.add(member)

    def discard(self, member: T) -> None:
        if member in self._slot:  # most calls (a lock walk's ancestors) end here: no candidate
            self._heaps.touched(member, self._slot.pop(member))  # its heap entries wait to be dropped or reused

    def refresh(self, member: T) -> None:
        """An access settles the duels ``member`` was kept in; a hit may move it up a class."""
        if member in self._dueling:
            self._settle(member, None)
        if member in self._slot:
            slot, heaps, hits = self._slot[member], self._heaps, member.hit_count
            if slot % self.num_classes != (heaps.classes[hits] if hits < heaps.top_class_hits else heaps.top_class):
                heaps.add(member)  # up a class
            else:
                heaps.touched(member, slot)

    def pop(self) -> T | None:
        """Evict by the learned order (module docstring), open the duels where other orders differ; remember it."""
        heaps, num_classes, shift = self._heaps, self.num_classes, self.shift
        heads = heaps.heads()
        top, deep = group_bests(heads, num_classes, shift)
        oldest = heads[-1] if deep is not None else None
        by_age = False
        if deep is not None:
            below = deep[0][1]
            if oldest is not None:
                hits = oldest[2].hit_count
                old_shifted = (
                    oldest[0] + (heaps.classes[hits] if hits < heaps.top_class_hits else num_classes - 1) * shift
                )
                if old_shifted + self.depth_shift < below:
                    by_age, below = True, old_shifted
            if top is not None and below >= top[0][1] + self.top_shift:
                deep = None
        chosen = deep if deep is not None else top
        if chosen is None:
            return None
        best, recency, frequency = chosen
        slot, deepest = best[3], heads[best[3]][-1]  # type: ignore[index]
        if by_age and deep is not None:  # recency across depths decided, not the class shift: no class duel
            slot = self._slot[oldest[2]]  # type: ignore[index]
            member = heaps.pop_recent()
        else:
            member = heaps.pop(slot)
        ghost_key = self._ghost_key(member)
        # The victim is known by its ghost key (it comes back as a miss there); a kept leaf by itself while
        # cached (an access refreshes it, a match inside it splits and re-adds it: no key to compute on the
        # hot path), and by its ghost key once it is evicted in turn. Each duel names the leaf another order
        # would have evicted and the way the order that would have kept the victim moves its shift.
        duels = self._duels
        if member in self._dueling:
            duels.rekey(member, ghost_key)
        if by_age and deep is not None:
            if deepest is not member:  # more depth shift would have kept it
                duels.open(ghost_key, deepest, +1, DEPTH)
        else:
            if recency[3] != slot:  # the victim was the less-reused: less shift would have kept it
                duels.open(ghost_key, recency[-1], -1, CLASS)
            if frequency[3] != slot:  # the victim was the more-reused: more shift would have kept it
                duels.open(ghost_key, frequency[-1], +1, CLASS)
            if deep is not None and oldest is not None and oldest[2] is not member:  # recency across depths
                duels.open(ghost_key, oldest[2], -1, DEPTH)  # would have kept the victim: less depth shift
        self._ghosts.remember(ghost_key, slot // num_classes, self._clock(), self._size(member), member.hit_count)
        return member

    def note_lookup(self, key: object, now: float) -> None:
        """Whole requests teach this set nothing: it learns where lookups stop (``note_miss``)."""

    def note_finished(self, key: object, now: float) -> None:
        """Whole requests teach this set nothing: it learns where lookups stop (``note_miss``)."""

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where an evicted leaf would have continued: settle its duels, learn the top shift."""
        if ghost_key in self._dueling:
            self._settle(ghost_key, now)
        taken = self._ghosts.take(ghost_key)
        if taken is None:
            return
        ghost, share = taken
        if ghost.hit_count:
            self._revived[ghost_key] = ghost.hit_count
            if len(self._revived) > self.MAX_REVIVED:
                self._revived.popitem(last=False)
        horizon = self._ghosts.horizon(now, ghost.evicted_at)
        step = self.TOP_LEARNING_RATE * horizon * share
        if ghost.group:  # a leaf below the top level came back: the deep-first order erred
            self.top_shift = max(self.top_shift - step, 0.0)
        else:
            self.top_shift = min(self.top_shift + step, self.MAX_TOP_SHIFT * horizon)

    def _settle(self, key: Hashable, now: float | None) -> None:
        """A request reached ``key``: the duels it decides move the shifts (``now`` None: read the clock if so).

        Each net vote scales a shift, counted in ghost horizons, by 2**learning_rate within [MIN_SHIFT,
        MAX_SHIFT]; at the floor the shift is 0."""
        vote, depth_vote = self._duels.settle(key)
        if not (vote or depth_vote):
            return
        now = self._clock() if now is None else now
        horizon, low, high = self._ghosts.horizon(now, now), self.MIN_SHIFT, self.MAX_SHIFT
        if vote:
            scaled = min(max(self.shift_horizons * 2.0 ** (vote * self.learning_rate), low), high)
            self.shift_horizons, self.shift = scaled, 0.0 if scaled <= low else scaled * horizon
        if depth_vote:
            scaled = min(max(self.depth_shift_horizons * 2.0 ** (depth_vote * self.learning_rate), low), high)
            self.depth_shift_horizons, self.depth_shift = scaled, 0.0 if scaled <= low else scaled * horizon

    def check(self) -> None:
        self._heaps.check()
        self._ghosts.check()
        assert self.shift >= 0.0 and self.top_shift >= 0.0 and self.depth_shift >= 0.0
        assert len(self._revived) <= self.MAX_REVIVED and all(self._revived.values()), "revived counts"
        assert self.MIN_SHIFT <= self.shift_horizons <= self.MAX_SHIFT
        assert self.MIN_SHIFT <= self.depth_shift_horizons <= self.MAX_SHIFT
        self._duels.check()
