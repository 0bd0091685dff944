"""Thrash-resistant insertion in the radix tree (``bench insertion``): where a leaf nobody has read yet enters.

Cache-line insertion policies, translated to leaves. A leaf is *fresh* until something reads it (a lookup touches
it, or a finished request reuses it); a read promotes it to the recency order, as LRU does. What differs is where a
fresh leaf enters:

- ``LeafBIP``: at the LRU end, newest first (LIP, Qureshi et al., ISCA '07), except every ``epsilon``-th (BIP);
- ``ConversationBIP``: the unit is a conversation, since the next turn reads what the last one inserted: a new
  leaf continuing an admitted or read tail is admitted, any other every ``epsilon``-th time;
- ``MiddleInsertion``: ``delay`` seconds back in the recency order (SRRIP's "long" re-reference interval, Jaleel
  et al., ISCA '10);
- ``DuelingMiddle``: that delay a share k of the pool's oldest age, k fixed or chosen by set dueling (DRRIP).

The ``open-*`` variants shift only a conversation's fresh first turn (``TreeNode.turn`` 0); ``TurnOdds`` learns
each fresh leaf's odds of being read from its turn and where it ends, and shifts it by them.

None met issue 36's targets (docs/benchmarks/index.md), so they live beside the benchmarks, not in the package.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from radixserve.cache.core.candidates import CandidateHeap, CandidateSet, Ranked
from radixserve.cache.core.policy import CandidateHooks, EvictionStrategy, NodeStats, Rank

T = TypeVar("T", bound=Ranked)


def _fresh(node: Any) -> bool:  # a NodeStats; Any: the candidate sets hold a TypeVar
    """Never read since it was inserted: no finished request reused it, no lookup touched it."""
    return bool(node.hit_count == 0 and node.last_access_time == node.creation_time)


def _fresh_opening(node: Any) -> bool:
    """Fresh, and a conversation's first turn (``TreeNode.turn``: no finished request ended on its path above)."""
    return bool(node.turn == 0 and _fresh(node))


class LeafBIP(EvictionStrategy):
    """Fresh leaves below every read one, the newest first (LIP's insertion at the LRU end), except every
    ``epsilon``-th node (by id, a deterministic counter), which enters at the MRU end; a read promotes (LRU)."""

    def __init__(self, epsilon: int = 0) -> None:
        self.epsilon = epsilon

    def rank(self, node: NodeStats) -> Rank:
        chosen = self.epsilon > 0 and getattr(node, "id", 1) % self.epsilon == 0
        return (1.0, node.last_access_time) if chosen or not _fresh(node) else (0.0, -node.creation_time)


class ConversationBIP(EvictionStrategy):
    """A new leaf that continues a conversation tail (a parent with at most two children, not the root) inherits
    the tail's admission, or is admitted when the tail was read since its insert; any other new leaf is admitted
    every ``epsilon``-th time. Unadmitted fresh leaves go first (LRU among them), then LRU over the rest."""

    def __init__(self, epsilon: int) -> None:
        self.epsilon, self._count = epsilon, 0
        self._admitted: dict[Any, bool] = {}  # node -> admitted; a node leaves it when evicted

    def rank(self, node: NodeStats) -> Rank:
        return (1.0 if not _fresh(node) or self._admit(node) else 0.0, node.last_access_time)

    def _admit(self, node: Any) -> bool:
        flag = self._admitted.get(node)
        if flag is None:
            parent = node.parent
            tail = parent is not None and parent.parent is not None and len(parent.children) <= 2
            # A split's upper half is a new node: it stands for the tail it was cut from (its other child).
            kin = [parent, *(c for c in parent.children.values() if c is not node)] if tail else []
            inherited = any(self._admitted.get(n) or n.last_access_time > n.creation_time for n in kin)
            self._count += 1
            flag = inherited or self._count % self.epsilon == 0
            self._admitted[node] = flag
        return flag

    def evict_len(self, node: Any, node_len: int, wanted: int) -> int:
        self._admitted.pop(node, None)  # bounded: only nodes in the tree are remembered
        return node_len


class MiddleInsertion(EvictionStrategy):
    """A fresh leaf counts as ``delay`` seconds older than it is (SRRIP: inserted at a "long" re-reference
    interval, promoted to recency on a read); 0 is LRU, a large delay SLRU-like. ``shifted``: which leaves count
    older (every fresh one, or a conversation's fresh first turn)."""

    def __init__(self, delay: float, shifted: Callable[[Any], bool] = _fresh) -> None:
        self.delay, self.shifted = delay, shifted

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time - self.delay if self.shifted(node) else node.last_access_time,)


def _last_access(node: Any) -> Rank:
    return (node.last_access_time,)


class DuelingMiddle(Generic[T]):
    """Fresh leaves count as k x the pool's oldest age older than they are (how long content lasts in the pool
    at this load, so one k serves any capacity and arrival rate). With two ks, DRRIP's set dueling: one leaf in
    ``LEADERS`` (by id) always uses ``ks[0]``, another ``ks[1]``; the rest follow the leader group whose evicted
    leaves were read back less (ghost hits, in tokens, a counter saturating at ``SATURATION`` pools).

    Fresh leaves in one recency heap per group, read ones in another; a pop compares the four oldest ends,
    O(log n). Bounded: ghosts of leader leaves only, at most a pool of tokens. Deterministic given the trace.
    """

    LEADERS = 16
    SATURATION = 0.05

    def __init__(
        self,
        tie_break: Callable[[T], int],
        hooks: CandidateHooks,
        ks: tuple[float, float],
        shifted: Callable[[T], bool] = _fresh,
    ) -> None:
        self._shifted = shifted  # the leaves the ks apply to (fresh ones; a subset of them)
        self._heaps = [CandidateHeap[T](_last_access, tie_break, True) for _ in range(4)]  # fresh A, B, rest; read
        self._where: dict[T, int] = {}
        self._tie_break, self._hooks, self.ks = tie_break, hooks, ks
        self.capacity_len = max(hooks.capacity_len, 1)
        self.choice = 0.0  # > 0: the B leaders missed less, the rest follow B
        self._ghosts: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()  # ghost key -> (group, tokens)
        self.ghost_len = 0
        self.now = -math.inf

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, member: T) -> bool:
        return member in self._where

    def __iter__(self) -> Iterator[T]:
        return iter(self._where)

    def add(self, member: T) -> None:
        self.discard(member)
        group = min(self._tie_break(member) * 2654435761 % 2**32 % self.LEADERS, 2) if self._shifted(member) else 3
        self._where[member] = group
        self._heaps[group].add(member)

    def discard(self, member: T) -> None:
        group = self._where.pop(member, None)
        if group is not None:
            self._heaps[group].discard(member)

    def refresh(self, member: T) -> None:
        if self._where.get(member, 3) < 3 and not self._shifted(member):  # its first read: into the recency order
            self.discard(member)
            self._where[member] = 3
            self._heaps[3].add(member)

    def pop(self) -> T | None:
        tops = [(m, g) for g, heap in enumerate(self._heaps) if (m := heap.peek()) is not None]
        if not tops:
            return None
        age = max(self.now - min(m.last_access_time for m, _ in tops), 0.0)
        ks = (*self.ks, self.ks[self.choice > 0], 0.0)
        member, group = min(tops, key=lambda t: (t[0].last_access_time - ks[t[1]] * age, t[1]))
        self._heaps[group].pop()
        del self._where[member]
        if group < 2 and self.ks[0] != self.ks[1]:
            self._remember(self._hooks.ghost_key(member), group, self._hooks.node_len(member))
        return member

    def _remember(self, key: Hashable, group: int, length: int) -> None:
        old = self._ghosts.pop(key, None)
        self.ghost_len += length - (old[1] if old is not None else 0)
        self._ghosts[key] = (group, length)
        while self.ghost_len > self.capacity_len and len(self._ghosts) > 1:
            self.ghost_len -= self._ghosts.popitem(last=False)[1][1]

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """A lookup stopped where a leader's leaf was evicted: a miss its insertion point caused."""
        self.now = max(self.now, now)
        ghost = self._ghosts.pop(ghost_key, None)
        if ghost is not None:
            self.ghost_len -= ghost[1]
            bound = self.SATURATION * self.capacity_len
            self.choice = min(max(self.choice + (ghost[1] if ghost[0] == 0 else -ghost[1]), -bound), bound)

    def note_lookup(self, key: object, now: float) -> None:
        self.now = max(self.now, now)

    def note_finished(self, key: object, now: float) -> None:
        self.now = max(self.now, now)

    def check(self) -> None:
        for heap in self._heaps:
            heap.check()
        assert all(self._where[m] == g for g, heap in enumerate(self._heaps) for m in heap), "a leaf misfiled"
        assert all((g == 3) != self._shifted(m) for m, g in self._where.items()), "a read leaf among the fresh"
        assert self.ghost_len == sum(n for _, n in self._ghosts.values()), "ghost tokens drifted"
        assert self.ghost_len <= self.capacity_len or len(self._ghosts) == 1, "ghosts unbounded"


class DuelingMiddleInsertion(EvictionStrategy):
    def __init__(self, ks: tuple[float, float], shifted: Callable[[Any], bool] = _fresh) -> None:
        self.ks, self.shifted = ks, shifted

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)  # within a heap; the candidate set compares the heaps

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return DuelingMiddle(tie_break, hooks, self.ks, self.shifted)


def _turn_class(node: Any, length: int) -> tuple[int, int]:
    """A fresh leaf's class: its conversation turn (0, 1, 2-3, 4+) and the octave of where it ends (its prompt's
    length: short one-off prompts are rarely continued)."""
    return min(node.turn.bit_length(), 3), min((node.depth + length).bit_length(), 24)


class TurnOdds(Generic[T]):
    """Fresh leaves shifted by how their class's odds of being read compare with all fresh leaves': a leaf counts
    ``k`` x the pool's age x (1 - p(class) / p(all)) older than it is (a likelier class younger); a read puts it in
    the recency order (LRU). p(class) is learned online: a fresh leaf read (a lookup or insert touches it, or
    splits it: its head was read) counts one read, one evicted unread one miss, turned into a read when a lookup
    stops at its ghost. The pool's age: the mean age of the evicted leaves (an average over 64 evictions).

    One heap; a leaf's shift is fixed when it enters (SRRIP-like), so a pop is O(log n). Bounded: at most 4 x 25
    classes' counts, ghosts of at most a pool of tokens. Deterministic given the trace."""

    DECAY = 0.5  # a class's counts halve past MAX_COUNT
    MAX_COUNT = 2000.0
    AGE_WEIGHT = 1.0 / 64

    def __init__(self, tie_break: Callable[[T], int], hooks: CandidateHooks, k: float, classes: str) -> None:
        self._heap = CandidateHeap[T](self._rank, tie_break, False)
        self._shift: dict[T, tuple[tuple[int, int] | None, float]] = {}  # member -> (class while unread, shift)
        self._hooks, self.k, self._classes = hooks, k, classes
        self.capacity_len = max(hooks.capacity_len, 1)
        self.counts: dict[tuple[int, int], list[float]] = {}  # class -> [reads, misses]
        self._ghosts: OrderedDict[Hashable, tuple[tuple[int, int], int]] = OrderedDict()
        self.ghost_len = 0
        self.pool_age = 0.0
        self.now = -math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, member: T) -> bool:
        return member in self._heap

    def __iter__(self) -> Iterator[T]:
        return iter(self._heap)

    def _rank(self, member: T) -> Rank:
        return (member.last_access_time - self._shift[member][1],)

    def _class(self, member: T) -> tuple[int, int]:
        cls = _turn_class(member, self._hooks.node_len(member))
        return (cls[0], 0) if self._classes == "turn" else cls

    def add(self, member: T) -> None:
        entry = self._shift.get(member)
        if entry is not None and entry[0] is not None:  # re-filed after a split: its head was read
            self._count(entry[0], 0)
            self._shift[member] = (None, entry[1])  # its fate is counted; it keeps its place
        elif entry is None:
            self._shift[member] = (self._class(member), self._new_shift(member)) if _fresh(member) else (None, 0.0)
        self._heap.discard(member)
        self._heap.add(member)

    def _new_shift(self, member: T) -> float:
        cls = self._class(member)
        reads, misses = self.counts.get(cls, (0.0, 0.0))
        total_reads = sum(c[0] for c in self.counts.values())
        total = sum(c[0] + c[1] for c in self.counts.values())
        p_all, p_cls = (total_reads + 1.0) / (total + 2.0), (reads + 1.0) / (reads + misses + 2.0)
        return self.k * self.pool_age * max(min(1.0 - p_cls / p_all, 1.0), -1.0)

    def discard(self, member: T) -> None:
        self._heap.discard(member)
        self._shift.pop(member, None)  # locked or a parent now: if it comes back, it enters as new

    def refresh(self, member: T) -> None:
        entry = self._shift.get(member)
        if entry is None:
            return
        if entry[0] is not None and not _fresh(member):  # its first read
            self._count(entry[0], 0)
        self._shift[member] = (None, 0.0)
        self._heap.discard(member)
        self._heap.add(member)

    def pop(self) -> T | None:
        member = self._heap.pop()
        if member is None:
            return None
        cls = self._shift.pop(member)[0]
        self.pool_age += self.AGE_WEIGHT * (max(self.now - member.last_access_time, 0.0) - self.pool_age)
        if cls is not None:  # evicted unread: a miss, until its ghost is read
            self._count(cls, 1)
            self._remember(self._hooks.ghost_key(member), cls, self._hooks.node_len(member))
        return member

    def _count(self, cls: tuple[int, int], which: int, by: float = 1.0) -> None:
        row = self.counts.setdefault(cls, [0.0, 0.0])
        row[which] = max(row[which] + by, 0.0)
        if row[0] + row[1] > self.MAX_COUNT:
            row[0], row[1] = row[0] * self.DECAY, row[1] * self.DECAY

    def _remember(self, key: Hashable, cls: tuple[int, int], length: int) -> None:
        old = self._ghosts.pop(key, None)
        self.ghost_len += length - (old[1] if old is not None else 0)
        self._ghosts[key] = (cls, length)
        while self.ghost_len > self.capacity_len and len(self._ghosts) > 1:
            self.ghost_len -= self._ghosts.popitem(last=False)[1][1]

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        self.now = max(self.now, now)
        ghost = self._ghosts.pop(ghost_key, None)
        if ghost is not None:
            self.ghost_len -= ghost[1]
            self._count(ghost[0], 1, -1.0)
            self._count(ghost[0], 0)

    def note_lookup(self, key: object, now: float) -> None:
        self.now = max(self.now, now)

    def note_finished(self, key: object, now: float) -> None:
        self.now = max(self.now, now)

    def check(self) -> None:
        self._heap.check()
        assert set(self._heap) == set(self._shift), "a member without its shift"
        assert self.ghost_len == sum(n for _, n in self._ghosts.values()), "ghost tokens drifted"
        assert self.ghost_len <= self.capacity_len or len(self._ghosts) == 1, "ghosts unbounded"
        assert len(self.counts) <= 4 * 25, "classes unbounded"


class TurnOddsInsertion(EvictionStrategy):
    rank_only_grows = False

    def __init__(self, k: float, classes: str = "turn-end") -> None:
        self.k, self.classes = k, classes

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)  # read leaves; the candidate set shifts the fresh ones

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return TurnOdds(tie_break, hooks, self.k, self.classes)


INSERTION: dict[str, Callable[[], EvictionStrategy]] = {
    "lip": LeafBIP,
    "bip32": lambda: LeafBIP(32),
    "conv-bip4": lambda: ConversationBIP(4),
    "conv-bip32": lambda: ConversationBIP(32),
    "mid60": lambda: MiddleInsertion(60.0),
    "mid300": lambda: MiddleInsertion(300.0),
    "mid-age0.5": lambda: DuelingMiddleInsertion((0.5, 0.5)),
    "drrip": lambda: DuelingMiddleInsertion((0.5, 1e9)),  # 1e9: fresh first (not inf: inf x an age of 0 is nan)
    "open-mid300": lambda: MiddleInsertion(300.0, _fresh_opening),
    "open-age0.5": lambda: DuelingMiddleInsertion((0.5, 0.5), _fresh_opening),
    "open-drrip": lambda: DuelingMiddleInsertion((0.5, 1e9), _fresh_opening),
    "odds-turn0.5": lambda: TurnOddsInsertion(0.5, "turn"),
    "odds1": lambda: TurnOddsInsertion(1.0),
}
