"""Eviction strategies: each ranks an evictable leaf; the lowest rank is evicted first.

Ranks are tuples so ties fall through to recency; the tree breaks any remaining
tie by node id, which makes the order deterministic under an injected clock.

A strategy also builds the candidate set a node store keeps its evictable
leaves in (``candidate_set``): a ranked heap for the fixed policies, the
class heaps and ghosts of ``cache/adaptive/`` for ``adaptive``. Any store (the
radix tree, a host or disk tier) can use any policy: it calls ``add`` /
``discard`` / ``refresh`` as nodes become, stop being or change as
candidates, ``pop`` to evict, and ``note_miss`` where a lookup stops.

Writing a strategy (the supported way to change what the tree evicts): subclass
``EvictionStrategy``, implement ``rank`` (set ``rank_only_grows = False`` when a
rank can fall), optionally ``candidate_set`` (a set of your own) and ``evict_len``
(free only a leaf's tail), and pass an instance as ``RadixCache(eviction_policy=...)``.
A strategy that ranks by a node's whole content reads it with ``RadixCache.path_key``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.cache.adaptive.candidates import AdaptiveCandidates
from radixserve.cache.core.candidates import CandidateHeap, CandidateSet, Rank
from radixserve.cache.learned.candidates import LearnedCandidates
from radixserve.cache.learned.dueling import DuelingCandidates
from radixserve.cache.learned.when import WhenCandidates

__all__ = ["EVICTION_POLICIES", "CandidateHooks", "EvictionStrategy", "NodeStats", "Rank", "create_eviction_strategy"]


@dataclass(frozen=True)
class CandidateHooks:
    """What a node set (a tree, a tier) tells a policy that learns from its evictions (see cache/adaptive/).

    ``ghost_key(node)``: where the node hangs (its parent and first page), the key a later lookup that
    stops there passes to ``note_miss``; ``node_len``: its tokens; ``clock``: the tree's clock;
    ``capacity_len``: the tokens the set can hold (ghosts remember at most that many).
    """

    ghost_key: Callable[[Any], Hashable]
    node_len: Callable[[Any], int]
    clock: Callable[[], float]
    capacity_len: int


class NodeStats(Protocol):
    last_access_time: float
    creation_time: float
    hit_count: int
    priority: int
    depth: int  # tokens above the node's first token


class EvictionStrategy(ABC):
    #: True when a node's rank can only go up (later access, more hits, higher priority),
    #: which lets the candidate heap re-rank lazily.
    rank_only_grows: bool = True

    @abstractmethod
    def rank(self, node: NodeStats) -> Rank: ...

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        """A fresh, empty candidate set ranked by this strategy (one per tree, rebuilt on reset)."""
        return CandidateHeap(self.rank, tie_break, self.rank_only_grows)

    def evict_len(self, node: Any, node_len: int, wanted: int) -> int:
        """How many tokens to free from the end of ``node``, the leaf ranked first, when ``wanted`` more
        are needed: all ``node_len`` of them, for every online policy.

        The extension point for a strategy that frees part of a leaf (the benchmarks' token-level Belady
        bound): returning fewer makes the tree split the leaf and free only that tail, rounded up to whole
        pages; the head stays cached and becomes a candidate itself. Called once per popped leaf, before
        anything changed; it must not change the tree.
        """
        return node_len


class LRUStrategy(EvictionStrategy):
    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)


class MRUStrategy(EvictionStrategy):
    rank_only_grows = False  # a read makes a node *more* evictable

    def rank(self, node: NodeStats) -> Rank:
        return (-node.last_access_time,)


class FIFOStrategy(EvictionStrategy):
    def rank(self, node: NodeStats) -> Rank:
        return (node.creation_time,)


class FILOStrategy(EvictionStrategy):
    def rank(self, node: NodeStats) -> Rank:
        return (-node.creation_time,)


class LFUStrategy(EvictionStrategy):
    def rank(self, node: NodeStats) -> Rank:
        return (node.hit_count, node.last_access_time)


class SLRUStrategy(EvictionStrategy):
    """Segmented LRU: nodes reused at least ``PROTECT_HITS`` times go after every probationary one.

    One reuse protects, as in SGLang (whose hit count includes the inserting
    request, so its threshold of 2 is our 1). Protecting only after a second
    reuse lost 1-5 points at 25% capacity on rag, branching and grouped prompts
    in ``bench simulate`` and tied on support-agent (issue 16).
    """

    PROTECT_HITS = 1

    def rank(self, node: NodeStats) -> Rank:
        return (float(node.hit_count >= self.PROTECT_HITS), node.last_access_time)


class PriorityStrategy(EvictionStrategy):
    """Lower request priority is evicted first, LRU within one priority."""

    def rank(self, node: NodeStats) -> Rank:
        return (node.priority, node.last_access_time)


class AdaptiveStrategy(EvictionStrategy):
    """Depth, recency and frequency, each weighed by what the workload rewards (cache/adaptive/).

    Rank in a group: (-depth, last_access_time + class * shift), classes 0, 1,
    2+ reuses, ``shift`` learned online from duels between this order and
    plain recency or frequency (0: LRU within a depth; large: LFU over the
    classes). Below the top level the oldest leaf by that shifted time goes
    instead of the deepest when it is older by ``depth_shift``, learned from
    duels between the two orders. The top level's best leaf goes instead of
    the one below when its shifted access time plus a ``top_shift`` learned
    from ghosts of evicted leaves is older.
    """

    NUM_CLASSES = 3  # hits 0, 1, 2+ (a fourth class, 4+, protected stale counts too long in the replays)
    DEPTH_LEARNING = True  # False: always the deepest leaf below the top level first (issue 16's fourth pass)
    LEARNING_RATE = 0.25  # each duel's vote scales the shift by 2**0.25 (AdaptiveCandidates._settle)

    def rank(self, node: NodeStats) -> Rank:
        return (-node.depth, node.last_access_time)  # within a class; across classes the candidate set adds the shift

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return AdaptiveCandidates(
            tie_break,
            hooks.ghost_key,
            hooks.node_len,
            hooks.clock,
            hooks.capacity_len,
            self.NUM_CLASSES,
            self.LEARNING_RATE,
            self.DEPTH_LEARNING,
        )


class LearnedStrategy(EvictionStrategy):
    """Nested ARC over the leaves (cache/learned/): reused leaves (LRU) against never-reused ones, these split
    into the top level (LRU) and below it (deepest first); each split's share of the candidates' tokens is
    learned from which segment's evicted leaves come back (ghost hits)."""

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)  # within a segment; which segment gives a leaf is the candidate set's call

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return LearnedCandidates(tie_break, hooks.ghost_key, hooks.node_len, hooks.capacity_len)


class MiniSimStrategy(EvictionStrategy):
    """The fixed policy (LRU, LFU, SLRU) whose miniature simulation on a spatial sample of the traffic serves the
    most hits lately (cache/learned/dueling.py); LFU until another leads by a margin."""

    CANDIDATES: tuple[type[EvictionStrategy], ...] = (LRUStrategy, LFUStrategy, SLRUStrategy)

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)  # the first candidate's; the candidate set ranks by its current choice

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        ranks = {cls.__name__.removesuffix("Strategy").lower(): cls().rank for cls in self.CANDIDATES}
        return DuelingCandidates(ranks, tie_break, hooks.capacity_len)


class WhenStrategy(EvictionStrategy):
    """The leaf least likely to be read again within the pool's horizon (how long its contents last), by its
    class (reused 0 / 1 / 2+ times, top level or below) and its age, from reuse gaps learned online
    (cache/learned/when.py); LRU until a pool's worth was evicted."""

    def rank(self, node: NodeStats) -> Rank:
        return (node.last_access_time,)  # within a class's oldest end; the candidate set compares classes and ends

    def candidate_set(self, tie_break: Callable[[Any], int], hooks: CandidateHooks) -> CandidateSet[Any]:
        return WhenCandidates(tie_break, hooks.ghost_key, hooks.node_len, hooks.capacity_len)


EVICTION_POLICIES: dict[str, type[EvictionStrategy]] = {
    "lru": LRUStrategy,
    "mru": MRUStrategy,
    "fifo": FIFOStrategy,
    "filo": FILOStrategy,
    "lfu": LFUStrategy,
    "slru": SLRUStrategy,
    "priority": PriorityStrategy,
    "adaptive": AdaptiveStrategy,
    "learned": LearnedStrategy,
    "minisim": MiniSimStrategy,
    "when": WhenStrategy,
}


def create_eviction_strategy(name: str) -> EvictionStrategy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}") from None
