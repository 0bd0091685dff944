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
    interval, promoted to recency on a read); 0 is LRU, a large delay SLRU-like."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time - self.delay if _fresh(node) else node.last_access_time,)


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
    ) -> None:
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
        group = min(self._tie_break(member) * 2654435761 % 2**32 % self.LEADERS, 2) if _fresh(member) else 3
        self._where[member] = group
        self._heaps[group].add(member)

    def discard(self, member: T) -> None:
        group = self._where.pop(member, None)
        if group is not None:
            self._heaps[group].discard(member)

    def refresh(self, member: T) -> None:
        if self._where.get(member, 3) < 3 and not _fresh(member):  # its first read: into the recency order
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
        assert all((g == 3) != _fresh(m) for m, g in self._where.items()), "a read leaf among the fresh"
        assert self.ghost_len == sum(n for _, n in self._ghosts.values()), "ghost tokens drifted"
        assert self.ghost_len <= self.capacity_len or len(self._ghosts) == 1, "ghosts unbounded"


class DuelingMiddleInsertion(EvictionStrategy):
    def __init__(self, ks: tuple[float, float]) -> None:
        self.ks = ks

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)  # within a heap; the candidate set compares the heaps

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return DuelingMiddle(tie_break, hooks, self.ks)


INSERTION: dict[str, Callable[[], EvictionStrategy]] = {
    "lip": LeafBIP,
    "bip32": lambda: LeafBIP(32),
    "conv-bip4": lambda: ConversationBIP(4),
    "conv-bip32": lambda: ConversationBIP(32),
    "mid60": lambda: MiddleInsertion(60.0),
    "mid300": lambda: MiddleInsertion(300.0),
    "mid-age0.5": lambda: DuelingMiddleInsertion((0.5, 0.5)),
    "drrip": lambda: DuelingMiddleInsertion((0.5, 1e9)),  # 1e9: fresh first (not inf: inf x an age of 0 is nan)
}
