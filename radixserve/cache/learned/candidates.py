"""The ``learned`` eviction candidate set: ARC (Megiddo & Modha, FAST '03) over the radix tree's leaves, nested.

Leaves fall in segments by what the traffic has shown of them. ``T2``: reused at least once by a finished
request (a shared document, a tree's root, a system prompt whose children are gone). ``T1``: never reused,
split by where the leaf hangs: at the top level (nothing cached above it: a one-off prompt, a new tree's root)
or below a cached prefix (a conversation's newest turn, a question below a document, a thought's last step).
T2 and T1's top level are LRU heaps; T1 below the top level goes deepest first (then least recent): the most
specific content, as ``adaptive`` found on thought trees and grouped prompts (BENCHMARKS §2).

A pop takes from T1 while T1 holds more than the learned ``share`` of the candidates' tokens, else from T2;
within T1, from its top level while that holds more than the learned ``top_share`` of T1's tokens, else the
deepest leaf below.

Both shares are learned online from ghosts, by ARC's rule in tokens: every evicted leaf leaves one where it
hung (its segment, its length); each segment's ghosts hold at most ``GHOST_REACH`` pools' worth of tokens,
oldest forgotten first. A lookup that stops exactly at a ghost (``note_miss``) is a reuse this cache missed:
the ghost's segment should have had more room, so its share grows by ``STEP`` x the ghost's length x
max(1, the rival's ghost tokens / its own) / the pool, and the rival's shrinks. Recency-friendly traffic
(multi-turn chat, whose next turn reuses the newest leaf) pushes ``share`` up toward LRU; frequency-friendly
traffic (popular documents, tree roots) pushes it down toward SLRU; one-off prompts beside conversations
push ``top_share`` down, thought trees whose roots come back push it up.

Deterministic given the trace (no randomness, no clock read: the orders are the tree's access times and
depths, ties by node id), bounded (per member its segment, length and heap; ghosts at most 3 x
``GHOST_REACH`` pools' tokens), and at LRU's cost class: add / discard are one heap push or O(1), an access
O(1) (lazy heaps) unless a first hit re-files the leaf, a pop reads three heap heads and pops one (O(log n)
per evicted leaf).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from radixserve.cache.core.candidates import CandidateHeap, Ranked

TOP, REUSED, BELOW = 0, 1, 2  # segments: T1 at the top level, T2, T1 below a cached prefix


T = TypeVar("T", bound=Ranked)


def _least_recent(node: Ranked) -> tuple[float]:
    return (node.last_access_time,)


def _deepest(node: Ranked) -> tuple[float, float]:
    return (-node.depth, node.last_access_time)


class LearnedCandidates(Generic[T]):
    """Unlocked leaves for the ``learned`` policy; the interface of ``CandidateHeap`` plus the learned shares."""

    GHOST_REACH = 1.0  # each segment's ghosts hold at most this many pools' worth of tokens
    # Of ARC's step per ghost hit, tuned on the Mooncake first halves and the tuning seeds: the full step lost up
    # to 10 points on branching, 0.1 up to 5.
    STEP = 0.25
    INITIAL_SHARE = 0.5

    def __init__(
        self,
        tie_break: Callable[[T], int],
        ghost_key: Callable[[T], Hashable],
        size: Callable[[T], int],
        capacity_len: int,
    ) -> None:
        ranks = (_least_recent, _least_recent, _deepest)
        self._heaps: list[CandidateHeap[T]] = [CandidateHeap(rank, tie_break, True) for rank in ranks]
        self._member: dict[T, tuple[int, int]] = {}  # member -> (segment, tokens when filed)
        self.segment_len = [0, 0, 0]  # candidate tokens per segment
        self._ghost_key, self._size = ghost_key, size
        self._ghosts: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in ranks]  # key -> tokens
        self.ghost_len = [0, 0, 0]
        self.ghost_capacity_len = max(int(self.GHOST_REACH * capacity_len), 1)
        self.share = self.INITIAL_SHARE  # T1's share of the candidates' tokens
        self.top_share = self.INITIAL_SHARE  # T1's top level's share of T1's tokens

    def __len__(self) -> int:
        return len(self._member)

    def __contains__(self, member: T) -> bool:
        return member in self._member

    def __iter__(self) -> Iterator[T]:
        return iter(self._member)

    def add(self, member: T) -> None:
        """Make ``member`` a candidate, or re-file it (a split changed its length and depth, a hit its segment)."""
        self.discard(member)
        segment = REUSED if member.hit_count > 0 else (BELOW if member.depth > 0 else TOP)
        length = self._size(member)
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
        if entry is not None and entry[0] != REUSED and member.hit_count > 0:
            self.add(member)

    def pop(self) -> T | None:
        """Evict from T1 while it is over its share of the candidates' tokens (within T1, from the top level
        while that is over its share of T1), else from T2; each segment's first leaf by its order."""
        lens, heads = self.segment_len, [heap.peek() for heap in self._heaps]
        once_len = lens[TOP] + lens[BELOW]
        if heads[TOP] is None and heads[BELOW] is None:
            segment = REUSED
        elif heads[REUSED] is not None and once_len <= self.share * (once_len + lens[REUSED]):
            segment = REUSED
        elif heads[BELOW] is None or (heads[TOP] is not None and lens[TOP] > self.top_share * once_len):
            segment = TOP
        else:
            segment = BELOW
        member = self._heaps[segment].pop()
        if member is None:
            return None
        length = self._member.pop(member)[1]
        lens[segment] -= length
        self._remember(self._ghost_key(member), segment, length)
        return member

    def note_lookup(self, key: object, now: float) -> None:
        """Whole requests teach this set nothing: it learns where lookups stop (``note_miss``)."""

    def note_finished(self, key: object, now: float) -> None:
        """Whole requests teach this set nothing: it learns where lookups stop (``note_miss``)."""

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where an evicted leaf hung: its segment should have had more room."""
        for segment, ghosts in enumerate(self._ghosts):
            length = ghosts.pop(ghost_key, None)
            if length is None:
                continue
            self.ghost_len[segment] -= length
            once = self.ghost_len[TOP] + self.ghost_len[BELOW]
            if segment == REUSED:
                self.share = self._moved(self.share, -length, self.ghost_len[REUSED], once)
            else:
                self.share = self._moved(self.share, length, once, self.ghost_len[REUSED])
                rival = BELOW if segment == TOP else TOP
                sign = 1 if segment == TOP else -1
                self.top_share = self._moved(
                    self.top_share, sign * length, self.ghost_len[segment], self.ghost_len[rival]
                )
            return

    def _moved(self, share: float, length: int, own_ghost_len: int, rival_ghost_len: int) -> float:
        """ARC's step, in tokens over the pool: further when the rival's ghosts outnumber the hit segment's."""
        step = self.STEP * length * max(1.0, rival_ghost_len / max(own_ghost_len, 1)) / self.ghost_capacity_len
        return min(max(share + step, 0.0), 1.0)

    def _remember(self, key: Hashable, segment: int, length: int) -> None:
        for other, ghosts in enumerate(self._ghosts):  # one ghost per place: the newest
            old = ghosts.pop(key, None)
            if old is not None:
                self.ghost_len[other] -= old
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
        assert 0.0 <= self.share <= 1.0 and 0.0 <= self.top_share <= 1.0
