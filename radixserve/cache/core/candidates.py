"""The eviction candidate set: unlocked leaves, kept ranked incrementally.

A binary heap with lazy deletion and lazy re-ranking. Each node has at most
one live entry. Removing a member (it got locked, or a child) leaves its entry
in place, to be reused if it comes back with the same rank, or dropped when it
surfaces. When ranks only grow (every policy but MRU: access times, hit counts
and priorities only go up), a re-ranked member keeps its old, lower entry: when
that surfaces, the member goes back in at its true rank. So a cache hit on a
leaf costs O(1) here, and evicting k leaves costs O(k log n) amortised; no
call ever scans all leaves. The heap is rebuilt when dead entries outnumber
live ones, which keeps it O(nodes).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

if TYPE_CHECKING:
    from radixserve.cache.core.key import RadixKey

T = TypeVar("T", bound=Hashable)
Rank = tuple[float, ...]


class Ranked(Protocol):
    """What the learned candidate sets rank a tree node by (adaptive, learned)."""

    last_access_time: float
    hit_count: int
    depth: int

    def __hash__(self) -> int: ...


class CandidateSet(Protocol[T]):
    """What a tree needs of its eviction candidates (``CandidateHeap``, ``AdaptiveCandidates``)."""

    def __len__(self) -> int: ...
    def __contains__(self, member: T) -> bool: ...
    def __iter__(self) -> Iterator[T]: ...
    def add(self, member: T) -> None: ...
    def discard(self, member: T) -> None: ...
    def refresh(self, member: T) -> None: ...
    def pop(self) -> T | None: ...
    def note_miss(self, ghost_key: Hashable, now: float) -> None: ...
    def note_lookup(self, key: RadixKey, now: float) -> None: ...
    def note_finished(self, key: RadixKey, now: float) -> None: ...
    def check(self) -> None: ...


class CandidateHeap(Generic[T]):
    def __init__(self, rank: Callable[[T], Rank], tie_break: Callable[[T], int], rank_only_grows: bool) -> None:
        self._rank = rank
        self._tie_break = tie_break
        self._lazy = rank_only_grows
        self._heap: list[tuple[object, ...]] = []  # (*rank, tie-break, version, member): flat compares fast
        self._entry: dict[T, tuple[int, Rank]] = {}  # node -> (version, rank) of its live entry
        self._members: set[T] = set()
        self._version = 0

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: T) -> bool:
        return member in self._members

    def __iter__(self) -> Iterator[T]:
        return iter(self._members)

    def add(self, member: T) -> None:
        """Make ``member`` a candidate (idempotent)."""
        self._members.add(member)
        entry = self._entry.get(member)
        if entry is None or not self._entry_usable(entry[1], self._rank(member)):
            self._push(member)

    def discard(self, member: T) -> None:
        """Stop ``member`` being a candidate; its entry waits in case it comes back."""
        self._members.discard(member)

    def refresh(self, member: T) -> None:
        """``member``'s rank may have changed (an access, a hit, a priority)."""
        if self._lazy or member not in self._members:
            return
        if self._entry[member][1] != self._rank(member):
            self._push(member)

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where ``ghost_key`` would have continued; only adaptive sets learn from it."""

    def note_lookup(self, key: RadixKey, now: float) -> None:
        """A lookup of ``key``; only the minisim set replays it (its shadows count their hits)."""

    def note_finished(self, key: RadixKey, now: float) -> None:
        """A finished request's sequence ``key`` is inserted; only the minisim set replays it (its shadows)."""

    def pop(self) -> T | None:
        """Remove and return the lowest-ranked member, or None when there is none."""
        if self.peek() is None:
            return None
        member = cast(T, heapq.heappop(self._heap)[-1])
        del self._entry[member]
        self._members.discard(member)
        return member

    def peek(self) -> T | None:
        """The lowest-ranked member (left in place), or None; drops stale entries on the way."""
        while self._heap:
            top = self._heap[0]
            rank, version, member = cast(Rank, top[:-3]), top[-2], cast(T, top[-1])
            entry = self._entry.get(member)
            if entry is not None and entry[0] == version and member in self._members and self._rank(member) == rank:
                return member
            heapq.heappop(self._heap)
            if entry is None or entry[0] != version:
                continue  # superseded by a newer entry
            if member not in self._members:
                del self._entry[member]  # it re-enters through add() if it becomes a candidate again
                continue
            self._push(member)  # ranked up since this entry was made: go back in at the true rank
        return None

    def peek_key(self) -> tuple[object, ...]:
        """The heap key of ``peek()``'s member: (*rank, tie-break); call right after a non-None peek."""
        return self._heap[0][:-2]

    def check(self) -> None:
        """Every member has a live entry that surfaces no later than its true rank."""
        live = {(e[-2], e[-1]) for e in self._heap}
        for member in self._members:
            version, rank = self._entry[member]
            assert (version, member) in live, f"{member!r} has no heap entry"
            assert self._entry_usable(rank, self._rank(member)), f"{member!r}: entry rank {rank} would surface late"
        assert len(self._heap) <= 2 * len(self._entry) + 64, "dead heap entries were never compacted"

    def _is_live(self, heap_entry: tuple[object, ...]) -> bool:
        entry = self._entry.get(cast(T, heap_entry[-1]))
        return entry is not None and entry[0] == heap_entry[-2]

    def _entry_usable(self, entry_rank: Rank, true_rank: Rank) -> bool:
        return entry_rank <= true_rank if self._lazy else entry_rank == true_rank

    def _push(self, member: T) -> None:
        self._version += 1
        rank = self._rank(member)
        self._entry[member] = (self._version, rank)
        heapq.heappush(self._heap, (*rank, self._tie_break(member), self._version, member))
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
