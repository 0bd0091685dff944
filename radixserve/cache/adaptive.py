"""The adaptive eviction candidate set: deepest leaf first; within a depth, LRU within hit classes by a learned shift.

Leaves are ranked first by depth (tokens above the leaf's first token),
deepest first. A leaf deep in the tree is the most specific content there is:
the last turn of one conversation, a question asked once below a shared
document, a leaf step of one thought tree. A shallow node is what many future
requests start with (a system prompt, a document, a tree's root). In the
replays of ``bench simulate`` this order is most of the gain over LRU on
tree-of-thought traces and grouped prompts, and costs nothing on chat
(BENCHMARKS §2). Leaves at one depth are siblings or structurally alike
(documents under one system prompt), and there recency or frequency decides:

Leaves fall into classes by how often finished requests reused them: class 0
never (seen once), class c >= 1 about 2**(c-1) times (log2 buckets, capped).
Each class is an LRU heap (``CandidateHeap``) ordered by (-depth, last access).
To evict, the head of every class is compared at
``(-depth, last_access_time + c * shift)``: a reused leaf survives ``shift``
clock units longer per class than a cold one of the same depth. ``shift == 0``
is LRU within a depth; a large shift is LFU over log2 buckets.

The shift is learned from ghosts, as in ARC: every evicted leaf leaves a ghost
(its class, hit count, eviction time and length) under its place in the tree (parent id,
first page); ghosts hold at most ``ghost_capacity_len`` tokens (the pool's
size), oldest forgotten first. A lookup that stops exactly where a ghost would
have continued is a miss the other ranking might have avoided. A ghost of a
reused class says "frequency mattered": the shift grows; a ghost of class 0
says "recency mattered": it shrinks. Each step is ``learning_rate`` x the ghost
horizon (how long ago the oldest remembered ghost was evicted: the time scale
of this cache's turnover, in the tree's clock units) x the ghost's share of
its side's ghost tokens, so a hit among few ghosts moves the shift as much as
many hits among many (ARC's ratio): the shift settles where a remembered token
of either side is as likely to come back. It stays within [0, 4 horizons].

Frequency outlives eviction: the node a missed ghost's request inserts at the
ghost's place starts with the ghost's hit count instead of 0 (the "perfect
LFU" of the literature, which beats in-cache counts on Zipf popularity): a
popular document evicted in a burst of other traffic is protected again as
soon as it is back, instead of having to earn its reuses anew. The restored
count is the node's ``hit_count`` (a radix split copies it to both halves).

Costs: ``add``/``discard``/``refresh`` O(log n) at worst; a pop compares
``num_classes`` heads (a constant) and pops one heap: evicting k leaves stays
O(k log n). ``note_miss`` is one dict lookup. The tree keeps each node's depth
(O(1) per insert or split; a split leaf is re-added at its new depth).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar

from radixserve.cache.candidates import CandidateHeap


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
    """Unlocked leaves for the ``adaptive`` policy; the interface of ``CandidateHeap`` plus ``shift``."""

    MAX_SHIFT = 4.0  # horizons: beyond that the order is LFU's already, and unlearning would take long
    MAX_REVIVED = 1024  # missed ghosts awaiting their node's return (about one per request in flight)

    def __init__(
        self,
        tie_break: Callable[[T], int],
        ghost_key: Callable[[T], Hashable],
        size: Callable[[T], int],
        clock: Callable[[], float],
        ghost_capacity_len: int,
        num_classes: int = 3,
        learning_rate: float = 3.0,
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self._heaps = [CandidateHeap(_depth_then_recency, tie_break, True) for _ in range(num_classes)]
        self._class: dict[T, int] = {}  # member -> the heap it is in
        self._ghost_key, self._size, self._clock = ghost_key, size, clock
        # ghost key -> (class, evicted at, len, hit count)
        self._ghosts: OrderedDict[Hashable, tuple[int, float, int, int]] = OrderedDict()
        self._revived: OrderedDict[Hashable, int] = OrderedDict()  # a missed ghost's hit count, until re-inserted
        self._ghost_len, self.ghost_capacity_len = 0, ghost_capacity_len
        self._side_len = [0, 0]  # ghost tokens of class 0, of every other class
        self.num_classes, self.learning_rate = num_classes, learning_rate
        self.shift = 0.0  # clock units a leaf outlives one a class below it

    def __len__(self) -> int:
        return len(self._class)

    def __contains__(self, member: T) -> bool:
        return member in self._class

    def __iter__(self) -> Iterator[T]:
        return iter(self._class)

    def class_of(self, member: T) -> int:
        return hit_class(member.hit_count, self.num_classes)

    def add(self, member: T) -> None:
        if self._revived and not member.hit_count:  # back where a missed ghost was: its count goes on
            member.hit_count = self._revived.pop(self._ghost_key(member), 0)
        cls = self.class_of(member)
        old = self._class.get(member)
        if old is not None and old != cls:
            self._heaps[old].discard(member)
        self._class[member] = cls
        self._heaps[cls].add(member)

    def discard(self, member: T) -> None:
        cls = self._class.pop(member, None)
        if cls is not None:
            self._heaps[cls].discard(member)

    def refresh(self, member: T) -> None:
        """A hit may move ``member`` up a class; an access alone is handled lazily by its heap."""
        if member in self._class and self._class[member] != self.class_of(member):
            self.add(member)

    def pop(self) -> T | None:
        """Remove and return the leaf whose shifted recency is lowest; remember it as a ghost."""
        best: tuple[object, ...] | None = None
        best_cls = -1
        for cls, heap in enumerate(self._heaps):
            if heap.peek() is None:
                continue
            neg_depth, last_access, tie = heap.peek_key()
            key = (neg_depth, float(last_access) + cls * self.shift, tie)  # type: ignore[arg-type]
            if best is None or key < best:
                best, best_cls = key, cls
        if best is None:
            return None
        member = self._heaps[best_cls].pop()
        assert member is not None
        del self._class[member]
        self._remember(member, best_cls)
        return member

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where an evicted leaf would have continued: learn which ranking erred."""
        ghost = self._ghosts.pop(ghost_key, None)
        if ghost is None:
            return
        cls, evicted_at, length, hits = ghost
        if hits:
            self._revived[ghost_key] = hits
            if len(self._revived) > self.MAX_REVIVED:
                self._revived.popitem(last=False)
        side_len = self._side_len[cls > 0]  # this ghost's side, itself included
        self._forget(cls, length)
        oldest = next(iter(self._ghosts.values()))[1] if self._ghosts else evicted_at
        step = self.learning_rate * max(now - oldest, 0.0) * length / max(side_len, 1)
        if cls:
            self.shift = min(self.shift + step, self.MAX_SHIFT * max(now - oldest, 0.0))
        else:
            self.shift = max(self.shift - step, 0.0)

    def check(self) -> None:
        for cls, heap in enumerate(self._heaps):
            heap.check()
            assert set(heap) == {m for m, c in self._class.items() if c == cls}, f"class {cls} heap != its members"
        assert all(c == self.class_of(m) for m, c in self._class.items()), "a member sits in a stale class"
        assert self._ghost_len == sum(g[2] for g in self._ghosts.values()), "ghost token count drifted"
        assert self._side_len[0] == sum(g[2] for g in self._ghosts.values() if not g[0]), "cold ghost count drifted"
        assert self._ghost_len <= self.ghost_capacity_len or len(self._ghosts) == 1, "ghosts over capacity"
        assert self.shift >= 0.0
        assert len(self._revived) <= self.MAX_REVIVED and all(self._revived.values()), "revived counts"

    def _remember(self, member: T, cls: int) -> None:
        key = self._ghost_key(member)
        old = self._ghosts.pop(key, None)
        if old is not None:
            self._forget(old[0], old[2])
        length, now = self._size(member), self._clock()
        self._ghosts[key] = (cls, now, length, member.hit_count)
        self._ghost_len += length
        self._side_len[cls > 0] += length
        while self._ghost_len > self.ghost_capacity_len and len(self._ghosts) > 1:
            _, (old_cls, _, forgotten, _) = self._ghosts.popitem(last=False)
            self._forget(old_cls, forgotten)

    def _forget(self, cls: int, length: int) -> None:
        self._ghost_len -= length
        self._side_len[cls > 0] -= length


def _depth_then_recency(member: _Ranked) -> tuple[float, ...]:
    return (-member.depth, member.last_access_time)
