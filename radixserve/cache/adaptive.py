"""The adaptive eviction candidate set: deepest first below the top level; recency or frequency learned online.

A leaf's depth is the number of tokens above its first token. Below the top
level (depth > 0, under a cached prefix) the deepest leaf goes first. A deep
leaf is the most specific content there is: the newest turn of one
conversation, a question asked once below a shared document, a leaf step of
one thought tree. A shallow one is what many later requests start with (a
document, a thought tree's middle step). In the replays of ``bench simulate``
this order is most of the gain over LRU on tree-of-thought traces and grouped
prompts (BENCHMARKS §2). Among leaves of one depth (siblings, documents below
one system prompt) recency or frequency decides:

Leaves fall into classes by how often finished requests reused them: class 0
never (seen once), class c >= 1 about 2**(c-1) times (log2 buckets, capped).
Each class is an LRU heap (``CandidateHeap``) ordered by (-depth, last access),
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

Ghosts: every evicted leaf leaves a ghost (its heap, hit count, eviction
time and length) under its place in the tree (parent id, first page); ghosts
hold at most ``ghost_capacity_len`` tokens (the pool's size), oldest
forgotten first. A lookup that stops exactly where a ghost would have
continued moves ``top_shift`` by ``TOP_LEARNING_RATE`` x the horizon x the
ghost's share of its group's ghost tokens (ARC's ratio), within [0, 16
horizons].

Frequency outlives eviction: the node a missed ghost's request inserts at the
ghost's place starts with the ghost's hit count instead of 0 (the "perfect
LFU" of the literature, which beats in-cache counts on Zipf popularity): a
popular document evicted in a burst of other traffic is protected again as
soon as it is back, instead of having to earn its reuses anew. The restored
count is the node's ``hit_count`` (a radix split copies it to both halves).

Costs: ``add``/``discard``/``refresh`` O(log n) at worst; a pop compares
``2 * num_classes`` heads (a constant), pops one heap and opens at most two
duels: evicting k leaves stays O(k log n). ``note_miss`` and a ``refresh``
while duels are open are a dict lookup each (plus the duels they settle). The
tree keeps each node's depth (O(1) per insert or split; a split leaf is
re-added at its new depth).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar, cast

from radixserve.cache.candidates import CandidateHeap
from radixserve.cache.duels import Duels


class _Ranked(Protocol):
    last_access_time: float
    hit_count: int
    depth: int

    def __hash__(self) -> int: ...


T = TypeVar("T", bound=_Ranked)


def hit_class(hit_count: int, num_classes: int) -> int:
    """0 for a never-reused leaf, else 1 + floor(log2(hit_count)), capped at ``num_classes - 1``."""
    return min(hit_count.bit_length(), num_classes - 1)


class AdaptiveCandidates(Generic[T]):
    """Unlocked leaves for the ``adaptive`` policy; the interface of ``CandidateHeap`` plus the two shifts."""

    MIN_SHIFT, MAX_SHIFT = 1 / 64, 16.0  # horizons; at the floor the shift is 0 (LRU within a depth)
    MAX_TOP_SHIFT = 16.0  # horizons: tree roots are reused across long gaps (thought trees)
    TOP_LEARNING_RATE = 10.0  # top-level ghosts are few and far between: each must move the top shift further
    MAX_REVIVED = 1024  # missed ghosts awaiting their node's return (about one per request in flight)
    MAX_DUELS = 4096  # open duels (two per eviction at most); the oldest are dropped undecided

    def __init__(
        self,
        tie_break: Callable[[T], int],
        ghost_key: Callable[[T], Hashable],
        size: Callable[[T], int],
        clock: Callable[[], float],
        ghost_capacity_len: int,
        num_classes: int = 3,
        learning_rate: float = 0.25,
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        # Heap group * num_classes + class: group 0 the top level (depth 0), group 1 below a cached prefix.
        self._heaps = [CandidateHeap(_depth_then_recency, tie_break, True) for _ in range(2 * num_classes)]
        self._slot: dict[T, int] = {}  # member -> the heap it is in
        self._ghost_key, self._size, self._clock = ghost_key, size, clock
        # ghost key -> (heap slot, evicted at, len, hit count)
        self._ghosts: OrderedDict[Hashable, tuple[int, float, int, int]] = OrderedDict()
        self._revived: OrderedDict[Hashable, int] = OrderedDict()  # a missed ghost's hit count, until re-inserted
        self._ghost_len, self.ghost_capacity_len = 0, ghost_capacity_len
        self._group_len = [0, 0]  # ghost tokens of the top level, of below it
        self.num_classes, self.learning_rate = num_classes, learning_rate
        self._duels = Duels(self.MAX_DUELS)
        self.shift_horizons = 1.0  # the shift in ghost horizons, learned from duels
        self.shift = 0.0  # clock units a leaf outlives one a class below it (shift_horizons x the horizon)
        self.top_shift = 0.0  # clock units a top-level leaf outlives the deepest leaf below

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, member: T) -> bool:
        return member in self._slot

    def __iter__(self) -> Iterator[T]:
        return iter(self._slot)

    def class_of(self, member: T) -> int:
        return hit_class(member.hit_count, self.num_classes)

    def slot_of(self, member: T) -> int:
        return (member.depth > 0) * self.num_classes + self.class_of(member)

    def add(self, member: T) -> None:
        if self._revived and not member.hit_count:  # back where a missed ghost was: its count goes on
            member.hit_count = self._revived.pop(self._ghost_key(member), 0)
        slot = self.slot_of(member)
        old = self._slot.get(member)
        if old is not None and self._duels.pending and (vote := self._duels.settle(member)):
            self._learn(vote, self._clock())  # re-added after a hit or a split: an access
        if old is not None and old != slot:
            self._heaps[old].discard(member)
        self._slot[member] = slot
        self._heaps[slot].add(member)

    def discard(self, member: T) -> None:
        slot = self._slot.pop(member, None)
        if slot is not None:
            self._heaps[slot].discard(member)

    def refresh(self, member: T) -> None:
        """An access settles the duels ``member`` was kept in; a hit may move it up a class."""
        if self._duels.pending and (vote := self._duels.settle(member)):
            self._learn(vote, self._clock())
        if member in self._slot and self._slot[member] != self.slot_of(member):
            self.add(member)

    def pop(self) -> T | None:
        """Evict the deepest leaf below the top level unless the oldest top-level one is older; remember it."""
        best: list[tuple[float, float, int, int] | None] = [None, None]  # per group: -depth, shifted, tie, slot
        recency: list[tuple[float, float, int, int] | None] = [None, None]  # per group, at shift 0
        frequency: list[tuple[float, int] | None] = [None, None]  # per group, at shift oo: -depth, slot
        for slot, heap in enumerate(self._heaps):
            if heap.peek() is None:
                continue
            group, cls = divmod(slot, self.num_classes)
            neg_depth, last_access, tie = cast(tuple[float, float, int], heap.peek_key())
            key = (neg_depth, last_access + cls * self.shift, tie, slot)
            if (old := best[group]) is None or key < old:
                best[group] = key
            if self.shift:  # at shift 0 the recency order is the shifted one: no duel to open
                key = (neg_depth, last_access, tie, slot)
                if (old := recency[group]) is None or key < old:
                    recency[group] = key
            if (low := frequency[group]) is None or neg_depth < low[0]:  # slots ascend: the lowest class first
                frequency[group] = (neg_depth, slot)
        group = 1 if best[1] is not None and (best[0] is None or best[1][1] < best[0][1] + self.top_shift) else 0
        chosen = best[group]
        if chosen is None:
            return None
        # Where recency alone, or frequency by class alone, would have evicted another leaf (of this
        # depth: the group's deepest), that leaf is kept in a duel against the victim (duels.py).
        slot, by_recency, by_frequency = chosen[3], recency[group], frequency[group]
        kept_by_recency = self._heaps[by_recency[3]].peek() if by_recency and by_recency[3] != slot else None
        kept_by_frequency = self._heaps[by_frequency[1]].peek() if by_frequency and by_frequency[1] != slot else None
        member = self._heaps[slot].pop()
        assert member is not None
        del self._slot[member]
        ghost_key = self._ghost_key(member)
        # The victim is known by its ghost key (it comes back as a miss there); a kept leaf by itself while
        # cached (an access refreshes it, a match inside it splits and re-adds it: no key to compute on the
        # hot path), and by its ghost key once it is evicted in turn.
        self._duels.rekey(member, ghost_key)
        if kept_by_recency is not None:  # the victim was the less-reused: less shift would have kept it
            self._duels.open(ghost_key, kept_by_recency, -1)
        if kept_by_frequency is not None:  # the victim was the more-reused: more shift would have kept it
            self._duels.open(ghost_key, kept_by_frequency, +1)
        self._remember(member, ghost_key, slot)
        return member

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where an evicted leaf would have continued: settle its duels, learn the top shift."""
        if self._duels.pending and (vote := self._duels.settle(ghost_key)):
            self._learn(vote, now)
        ghost = self._ghosts.pop(ghost_key, None)
        if ghost is None:
            return
        slot, evicted_at, length, hits = ghost
        if hits:
            self._revived[ghost_key] = hits
            if len(self._revived) > self.MAX_REVIVED:
                self._revived.popitem(last=False)
        group = slot // self.num_classes
        group_len = self._group_len[group]  # this ghost's group, itself included
        self._forget(slot, length)
        step = self.TOP_LEARNING_RATE * self._horizon(now, evicted_at) * length / max(group_len, 1)
        if group:  # a leaf below the top level came back: the deep-first order erred
            self.top_shift = max(self.top_shift - step, 0.0)
        else:
            self.top_shift = min(self.top_shift + step, self.MAX_TOP_SHIFT * self._horizon(now, evicted_at))

    def _horizon(self, now: float, fallback: float) -> float:
        """How long ago the oldest remembered ghost was evicted (``fallback`` when none is left)."""
        oldest = next(iter(self._ghosts.values()))[1] if self._ghosts else fallback
        return max(now - oldest, 0.0)

    def _learn(self, vote: int, now: float) -> None:
        """The net vote of the duels an access settled scales the shift, in horizons, by 2**learning_rate each."""
        scaled = self.shift_horizons * 2.0 ** (vote * self.learning_rate)
        self.shift_horizons = min(max(scaled, self.MIN_SHIFT), self.MAX_SHIFT)
        at_floor = self.shift_horizons <= self.MIN_SHIFT
        self.shift = 0.0 if at_floor else self.shift_horizons * self._horizon(now, now)

    def check(self) -> None:
        for slot, heap in enumerate(self._heaps):
            heap.check()
            assert set(heap) == {m for m, s in self._slot.items() if s == slot}, f"heap {slot} != its members"
        assert all(s == self.slot_of(m) for m, s in self._slot.items()), "a member sits in a stale heap"
        ghosts = self._ghosts.values()
        assert self._ghost_len == sum(g[2] for g in ghosts), "ghost token count drifted"
        assert self._group_len[0] == sum(g[2] for g in ghosts if g[0] < self.num_classes), "top ghosts drifted"
        assert self._ghost_len <= self.ghost_capacity_len or len(self._ghosts) == 1, "ghosts over capacity"
        assert self.shift >= 0.0 and self.top_shift >= 0.0
        assert len(self._revived) <= self.MAX_REVIVED and all(self._revived.values()), "revived counts"
        assert self.MIN_SHIFT <= self.shift_horizons <= self.MAX_SHIFT
        self._duels.check()

    def _remember(self, member: T, key: Hashable, slot: int) -> None:
        old = self._ghosts.pop(key, None)
        if old is not None:
            self._forget(old[0], old[2])
        length, now = self._size(member), self._clock()
        self._ghosts[key] = (slot, now, length, member.hit_count)
        self._ghost_len += length
        self._group_len[slot // self.num_classes] += length
        while self._ghost_len > self.ghost_capacity_len and len(self._ghosts) > 1:
            _, (old_slot, _, forgotten, _) = self._ghosts.popitem(last=False)
            self._forget(old_slot, forgotten)

    def _forget(self, slot: int, length: int) -> None:
        self._ghost_len -= length
        self._group_len[slot // self.num_classes] -= length


def _depth_then_recency(member: _Ranked) -> tuple[float, ...]:
    return (-member.depth, member.last_access_time)
