"""The adaptive policy's candidate heaps (candidates.py): one per hit class and group, one by recency alone.

Slot ``group * num_classes + class`` (group 0: the top level, depth 0; group
1: below a cached prefix) holds that group's leaves of that class ordered by
(-depth, last access, tie-break); with depth learning, every leaf of group 1
is also in one recency heap ordered by (last access, tie-break). The policy
reads every head on each eviction, so the heaps are built for that: plain
``heapq`` lists of flat tuples, one membership dict (member -> slot) for all
of them, and a head that is checked by identity, not by recomputing a rank.

Lazy as ``CandidateHeap`` (core/candidates.py): a discard only forgets the
member (its entries stay, to be dropped when they surface, or reused if it
comes back unchanged); an access only moves ``last_access_time``, and the
entry, now early, goes back in at its true time when it surfaces. A member's
live entry in each structure is the tuple its entry dict names: a class or
depth change pushes a new one (depth only grows, at a split), and the old one
is dropped when it surfaces. So an access costs nothing here, a head is one
dict lookup and one float compare, and evicting k leaves costs O(k log n)
amortised. Heads are kept as last read and read again only where a push, a
pop, or an access to or discard of the head's member can have moved them
(most evictions re-read one heap). Dead entries (and those of members that
left) are compacted away past 3 per member, looked at every len(members) + 64
pushes: memory stays O(members).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from radixserve.cache.core.candidates import Ranked

T = TypeVar("T", bound=Ranked)
# (-depth, last access, tie-break, slot, member) and (last access, tie-break, member): tie-breaks are unique, so
# a member is never compared. Typed loosely: heapq compares the tuples, the policy reads their fields by index.
Entry = tuple[Any, ...]


def hit_class(hit_count: int, num_classes: int) -> int:
    """0 for a never-reused leaf, else 1 + floor(log2(hit_count)), capped at ``num_classes - 1``."""
    return min(hit_count.bit_length(), num_classes - 1)


class ClassHeaps(Generic[T]):
    def __init__(self, num_classes: int, tie_break: Callable[[T], int], by_recency: bool) -> None:
        self.num_classes, self.by_recency = num_classes, by_recency
        # hit_class without a call on the hot paths: classes[hit_count] below top_class_hits, else top_class.
        self.top_class, self.top_class_hits = num_classes - 1, 1 << (num_classes - 2)
        self.classes = tuple(hit_class(hits, num_classes) for hits in range(self.top_class_hits))
        self._tie_break = tie_break
        self.slot: dict[T, int] = {}  # member -> its class heap; the policy reads it, and discards, directly
        self._heaps: list[list[Entry]] = [[] for _ in range(2 * num_classes)]
        self._entry: dict[T, Entry] = {}  # member -> its live class-heap entry
        self._size = 0  # entries in the class heaps, live or not
        self._pushes = 0  # since the last look at whether compaction is due
        self._recent: list[Entry] = []
        self._recent_entry: dict[T, Entry] = {}  # member -> its live recency entry (group 1 only)
        # Each heap's head as last read (the recency heap's last), valid unless its index is in _stale.
        self._heads: list[Entry | None] = [None] * (2 * num_classes + 1)
        self._recent_index = 2 * num_classes
        self._stale = set(range(2 * num_classes + 1))

    def slot_of(self, member: T) -> int:
        return (member.depth > 0) * self.num_classes + hit_class(member.hit_count, self.num_classes)

    def add(self, member: T) -> None:
        """``member`` is a candidate (new, back, or moved to another class or depth)."""
        num_classes, stale, heads, hits = self.num_classes, self._stale, self._heads, member.hit_count
        slot = (member.depth > 0) * num_classes + (self.classes[hits] if hits < self.top_class_hits else self.top_class)
        if member in self.slot:
            self.touched(member, self.slot[member])  # its entry, which a split or a hit replaces, may be a head
        self.slot[member] = slot
        entry, time, neg_depth, tie = self._entry.get(member), member.last_access_time, -member.depth, None
        if entry is None or entry[3] != slot or entry[0] != neg_depth or entry[1] > time:
            tie = self._tie_break(member)
            entry = (neg_depth, time, tie, slot, member)
            self._entry[member] = entry
            heapq.heappush(self._heaps[slot], entry)
            self._size += 1
            if slot not in stale and ((head := heads[slot]) is None or entry < head):
                heads[slot] = entry  # a head that is known stays known: the new entry is live
        if slot >= num_classes and self.by_recency and member not in self._recent_entry:
            recent = (time, self._tie_break(member) if tie is None else tie, member)
            self._recent_entry[member] = recent
            heapq.heappush(self._recent, recent)
            if self._recent_index not in stale and ((head := heads[-1]) is None or recent < head):
                heads[-1] = recent
        elif tie is None:
            return  # nothing pushed
        self._pushes += 1
        if self._pushes > len(self.slot) + 64:  # check now and then: entries stay O(members) between checks
            self._pushes = 0
            if self._size + len(self._recent) > 3 * len(self.slot) + 64:  # a member has at most 2 live entries
                self._compact()

    def touched(self, member: T, slot: int) -> None:
        """``member`` (in ``slot``) was accessed, or left ``slot`` (the caller removed it): the heads it was are
        to be read again. A member that leaves keeps its entries, to be dropped when they surface or reused."""
        head, recent = self._heads[slot], self._heads[-1]
        if head is not None and head[-1] is member:
            self._stale.add(slot)
        if recent is not None and recent[-1] is member:
            self._stale.add(self._recent_index)

    def heads(self) -> list[Entry | None]:
        """Each class heap's best live entry (index = slot), then the recency heap's; None where empty.
        Left in place; the list is this object's own (read it, do not keep it past the next change)."""
        stale, heads = self._stale, self._heads
        if stale:
            for index in stale:
                heads[index] = self._head(index) if index != self._recent_index else self._recent_head()
            stale.clear()
        return heads

    def _head(self, slot: int) -> Entry | None:
        heap, live, members = self._heaps[slot], self._entry, self.slot
        while heap:
            top = heap[0]
            member = top[4]
            if live.get(member) is top:
                if member in members:
                    if top[1] == member.last_access_time:
                        return top
                    entry = (top[0], member.last_access_time, top[2], slot, member)  # accessed since: re-rank
                    live[member] = entry
                    heapq.heapreplace(heap, entry)
                    continue
                del live[member]  # not a candidate any more: it re-enters through add()
            heapq.heappop(heap)
            self._size -= 1
        return None

    def _recent_head(self) -> Entry | None:
        heap, live, members = self._recent, self._recent_entry, self.slot
        while heap:
            top = heap[0]
            member = top[2]
            if member in members:
                if top[0] == member.last_access_time:
                    return top
                entry = (member.last_access_time, top[1], member)
                live[member] = entry
                heapq.heapreplace(heap, entry)
                continue
            del live[member]
            heapq.heappop(heap)
        return None

    def pop(self, slot: int) -> T:
        """Remove the best member of ``slot``; call right after ``heads()`` said it has one."""
        member: T = heapq.heappop(self._heaps[slot])[4]
        del self._entry[member], self.slot[member]
        self._size -= 1
        self._stale.add(slot)
        if (recent := self._heads[-1]) is not None and recent[-1] is member:
            self._stale.add(self._recent_index)
        return member

    def pop_recent(self) -> T:
        """Remove the least recently used member below the top level; call right after ``heads()`` showed one."""
        member: T = heapq.heappop(self._recent)[2]
        del self._recent_entry[member]
        self.touched(member, self.slot.pop(member))
        self._stale.add(self._recent_index)
        return member

    def _compact(self) -> None:
        """Keep only the members' live entries: O(entries), and at least a third of them go."""
        for slot, heap in enumerate(self._heaps):
            heap[:] = [e for e in heap if self._entry.get(e[4]) is e and self.slot.get(e[4]) == slot]
            heapq.heapify(heap)
        self._recent[:] = [e for e in self._recent if e[2] in self.slot]
        heapq.heapify(self._recent)
        self._entry = {e[4]: e for heap in self._heaps for e in heap}
        self._recent_entry = {e[2]: e for e in self._recent}
        self._size = sum(map(len, self._heaps))
        self._stale.update(range(len(self._heads)))

    def check(self) -> None:
        """Every member has a live entry in its slot's heap (and below the top level in the recency heap) that
        surfaces no later than its true rank; each head not marked stale is the one a fresh read gives."""
        in_heaps = [{id(e) for e in heap} for heap in self._heaps]
        recent = {id(e) for e in self._recent}
        for member, slot in self.slot.items():
            assert slot == self.slot_of(member), f"{member!r} sits in a stale heap"
            entry = self._entry[member]
            assert id(entry) in in_heaps[slot] and entry[3] == slot, f"{member!r} has no entry in heap {slot}"
            assert entry[0] == -member.depth and entry[1] <= member.last_access_time, f"{member!r}: entry {entry}"
            if slot >= self.num_classes and self.by_recency:
                entry = self._recent_entry[member]
                assert id(entry) in recent and entry[0] <= member.last_access_time, f"{member!r}: no recency entry"
        assert self._size == sum(map(len, self._heaps)) and len(self._recent) == len(self._recent_entry), "drifted"
        assert all(id(e) in in_heaps[e[3]] for e in self._entry.values()), "a live entry left its heap"
        for index, head in enumerate(self._heads):  # a fresh read only drops dead entries and re-ranks lazily
            fresh = self._head(index) if index != self._recent_index else self._recent_head()
            assert index in self._stale or fresh is head, f"heap {index}'s head went stale unmarked"


def group_bests(
    heads: list[Entry | None], num_classes: int, shift: float
) -> tuple[tuple[Entry, ...] | None, tuple[Entry, ...] | None]:
    """Per group (the top level, below it): its best head by the shifted order, as (-depth, shifted access,
    tie-break, slot), and the heads plain recency and frequency by class alone would evict; None if it has none."""
    return _group_best(heads, 0, num_classes, shift), _group_best(heads, num_classes, num_classes, shift)


def _group_best(heads: list[Entry | None], first: int, num_classes: int, shift: float) -> tuple[Entry, ...] | None:
    best: Entry | None = None
    for slot in range(first, first + num_classes):
        head = heads[slot]
        if head is None:
            continue
        key = (head[0], head[1] + (slot - first) * shift, head[2], slot)
        if best is None:
            best, recency, frequency = key, head, head
            continue
        if key < best:
            best = key
        if head < recency:  # tie-breaks are unique: (-depth, last access, tie-break) decides
            recency = head
        if head[0] < frequency[0]:  # classes ascend: the lowest of the deepest
            frequency = head
    return None if best is None else (best, recency, frequency)
