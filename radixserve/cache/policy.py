"""Eviction strategies: each ranks an evictable leaf; the lowest rank is evicted first.

Ranks are tuples so ties fall through to recency; the tree breaks any remaining
tie by node id, which makes the order deterministic under an injected clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol


class NodeStats(Protocol):
    last_access_time: float
    creation_time: float
    hit_count: int
    priority: int


Rank = tuple[float, ...]


class EvictionStrategy(ABC):
    #: True when a node's rank can only go up (later access, more hits, higher priority),
    #: which lets the candidate heap re-rank lazily.
    rank_only_grows: bool = True

    @abstractmethod
    def rank(self, node: NodeStats) -> Rank: ...


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
    """Segmented LRU: nodes hit at least ``PROTECT_HITS`` times go after every probationary one."""

    PROTECT_HITS = 2  # a second hit is what tells a reused prefix from a one-off

    def rank(self, node: NodeStats) -> Rank:
        return (float(node.hit_count >= self.PROTECT_HITS), node.last_access_time)


class PriorityStrategy(EvictionStrategy):
    """Lower request priority is evicted first, LRU within one priority."""

    def rank(self, node: NodeStats) -> Rank:
        return (node.priority, node.last_access_time)


EVICTION_POLICIES: dict[str, type[EvictionStrategy]] = {
    "lru": LRUStrategy,
    "mru": MRUStrategy,
    "fifo": FIFOStrategy,
    "filo": FILOStrategy,
    "lfu": LFUStrategy,
    "slru": SLRUStrategy,
    "priority": PriorityStrategy,
}


def create_eviction_strategy(name: str) -> EvictionStrategy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}") from None
