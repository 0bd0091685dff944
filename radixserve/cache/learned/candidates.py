"""The ``learned`` eviction candidate set: ARC (Megiddo & Modha, FAST '03) over the radix tree's leaves.

Leaves fall in two segments by what the traffic has shown of them: ``T1``, never reused by a finished request
(``hit_count == 0``: a one-off prompt, a conversation's newest turn, a question below a document), and ``T2``,
reused at least once (a shared document, a tree's root, a system prompt whose children are gone). Each is an
LRU heap (``CandidateHeap`` by last access). A pop evicts T1's least recent leaf while T1 holds more than the
learned share ``target`` of the candidates' tokens, else T2's.

``target`` is learned online from ghosts: every evicted leaf leaves one where it hung (its segment and
length), each segment's ghosts holding at most ``GHOST_REACH`` pools' worth of tokens, oldest forgotten
first. A lookup that stops exactly at a ghost (``note_miss``) is a reuse this cache missed: a T1 ghost means
the seen-once segment deserved more room (the share grows), a T2 ghost that the reused one did (it shrinks),
by ``STEP`` x the ghost's length x max(1, the other segment's ghost tokens / this one's) (ARC's rule, in
tokens). Recency-friendly traffic (multi-turn chat whose next turn reuses the newest leaf) pushes the share up
toward LRU; frequency-friendly traffic (popular documents, tree roots) pushes it down toward SLRU.

Deterministic given the trace (no randomness, no clock read: the order is by the tree's access times), bounded
(per member its segment and length; ghosts at most 2 x ``GHOST_REACH`` pools' tokens), and at LRU's cost
class: add / discard / an access are O(1) or one heap push, a pop reads two heap heads and pops one
(O(log n) per evicted leaf).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar

from radixserve.cache.core.candidates import CandidateHeap

SEEN_ONCE, REUSED = 0, 1


class Ranked(Protocol):
    last_access_time: float
    hit_count: int

    def __hash__(self) -> int: ...


T = TypeVar("T", bound=Ranked)


def _last_access(node: Ranked) -> tuple[float]:
    return (node.last_access_time,)


class LearnedCandidates(Generic[T]):
    """Unlocked leaves for the ``learned`` policy; the interface of ``CandidateHeap`` plus the learned share."""

    GHOST_REACH = 1.0  # each segment's ghosts hold at most this many pools' worth of tokens
    STEP = 0.25  # of ARC's adaptation per ghost hit (1.0 moved the share too far on each hit: see the module's tests)
    INITIAL_SHARE = 0.5  # of the candidates' tokens T1 may hold before it gives way to T2

    def __init__(
        self,
        tie_break: Callable[[T], int],
        ghost_key: Callable[[T], Hashable],
        size: Callable[[T], int],
        capacity_len: int,
    ) -> None:
        self._heaps: tuple[CandidateHeap[T], CandidateHeap[T]] = (
            CandidateHeap(_last_access, tie_break, True),
            CandidateHeap(_last_access, tie_break, True),
        )
        self._member: dict[T, tuple[int, int]] = {}  # member -> (segment, tokens when it joined)
        self.segment_len = [0, 0]  # candidate tokens in T1, T2
        self._ghost_key, self._size = ghost_key, size
        self._ghosts: tuple[OrderedDict[Hashable, int], OrderedDict[Hashable, int]] = (OrderedDict(), OrderedDict())
        self.ghost_len = [0, 0]  # ghost tokens of T1, T2
        self.ghost_capacity_len = max(int(self.GHOST_REACH * capacity_len), 1)
        self.share = self.INITIAL_SHARE  # learned: T1's share of the candidates' tokens

    def __len__(self) -> int:
        return len(self._member)

    def __contains__(self, member: T) -> bool:
        return member in self._member

    def __iter__(self) -> Iterator[T]:
        return iter(self._member)

    def add(self, member: T) -> None:
        """Make ``member`` a candidate, or re-file it (a split changed its length, a hit its segment)."""
        self.discard(member)
        segment, length = int(member.hit_count > 0), self._size(member)
        self._member[member] = (segment, length)
        self.segment_len[segment] += length
        self._heaps[segment].add(member)

    def discard(self, member: T) -> None:
        entry = self._member.pop(member, None)
        if entry is not None:
            self._heaps[entry[0]].discard(member)  # its heap entry waits, to be reused or dropped (lazy)
            self.segment_len[entry[0]] -= entry[1]

    def refresh(self, member: T) -> None:
        """An access: the heaps re-rank lazily; a first hit moves the leaf from T1 to T2."""
        entry = self._member.get(member)
        if entry is not None and entry[0] == SEEN_ONCE and member.hit_count > 0:
            self.add(member)

    def pop(self) -> T | None:
        """Evict T1's least recent leaf while T1 is over its share of the candidates' tokens, else T2's."""
        once, reused = self._heaps[SEEN_ONCE].peek(), self._heaps[REUSED].peek()
        if once is None and reused is None:
            return None
        over_share = self.segment_len[SEEN_ONCE] > self.share * (self.segment_len[SEEN_ONCE] + self.segment_len[REUSED])
        segment = SEEN_ONCE if reused is None or (once is not None and over_share) else REUSED
        member = self._heaps[segment].pop()
        assert member is not None
        length = self._member.pop(member)[1]
        self.segment_len[segment] -= length
        self._remember(self._ghost_key(member), segment, length)
        return member

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where an evicted leaf hung: its segment should have had more room."""
        for segment in (SEEN_ONCE, REUSED):
            length = self._ghosts[segment].pop(ghost_key, None)
            if length is None:
                continue
            self.ghost_len[segment] -= length
            other = self.ghost_len[1 - segment]
            step = self.STEP * length * max(1.0, other / max(self.ghost_len[segment], 1)) / self.ghost_capacity_len
            self.share = min(max(self.share + (step if segment == SEEN_ONCE else -step), 0.0), 1.0)
            return

    def _remember(self, key: Hashable, segment: int, length: int) -> None:
        for ghosts, seg in zip(self._ghosts, (SEEN_ONCE, REUSED)):  # one ghost per place: the newest
            old = ghosts.pop(key, None)
            if old is not None:
                self.ghost_len[seg] -= old
        ghosts = self._ghosts[segment]
        ghosts[key] = length
        self.ghost_len[segment] += length
        while self.ghost_len[segment] > self.ghost_capacity_len and len(ghosts) > 1:
            self.ghost_len[segment] -= ghosts.popitem(last=False)[1]

    def check(self) -> None:
        for segment, heap in enumerate(self._heaps):
            heap.check()
            members = [m for m, (s, _) in self._member.items() if s == segment]
            assert set(heap) == set(members), "a member in the wrong segment"
            assert self.segment_len[segment] == sum(self._member[m][1] for m in members), "segment tokens drifted"
            assert self.ghost_len[segment] == sum(self._ghosts[segment].values()), "ghost tokens drifted"
            assert self.ghost_len[segment] <= self.ghost_capacity_len or len(self._ghosts[segment]) == 1, "ghosts"
        assert 0.0 <= self.share <= 1.0
