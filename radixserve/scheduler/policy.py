"""Schedule policies: the order in which waiting requests are admitted (``--schedule-policy``).

Each round the scheduler admits from ``order(...).order`` until its budget runs
out. Cache-aware policies (lpm, dfs-weight, hrrn) match every waiting request
each round, never switching to FCFS past 128 waiting (SGLang's silent cutoff):
about 8 us per request. Then in-batch dedup (``dedup.py``) holds requests that
would prefill a cold prefix a request kept earlier this round will compute.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, cast

from radixserve.cache import BasePrefixCache, ChunkCache, RadixCache, TreeNode
from radixserve.scheduler.dedup import hold_in_batch_duplicates, match_request
from radixserve.scheduler.request import Request

logger = logging.getLogger(__name__)

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key", "priority", "hrrn")

MIN_SERVICE_S = 1e-3  # hrrn: floor on the estimated service, so a ratio never divides by ~0
# hrrn's service estimate, tokens per second per request. Only their ratio matters
# to the order: a prefill token is taken to cost 1/15 of a decode token's time.
HRRN_PREFILL_RATE = 300.0
HRRN_DECODE_RATE = 20.0


@dataclass
class PolicyResult:
    order: list[Request]  # admission order for this round; held requests are not in it
    held: list[Request] = field(default_factory=list)  # in-batch dedup: wait for a sibling to insert


@dataclass(frozen=True)
class SchedulePolicyParams:
    """Options of every policy; each reads the ones it needs."""

    in_batch_dedup: bool = True
    seed: int = 0  # random


class BaseSchedulePolicy(ABC):
    """Sorts the waiting queue (``_sort``), then applies in-batch dedup if enabled."""

    name: ClassVar[str]
    cache_aware: ClassVar[bool] = False  # order() matches every waiting request before _sort

    def __init__(self, params: SchedulePolicyParams) -> None:
        self.params = params

    def order(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> PolicyResult:
        """This round's admission order. Mutates the cache only as ``match_prefix`` does."""
        if self.cache_aware:  # sets req.match_len and req.match_node, which _sort reads
            for req in waiting:
                match_request(req, cache)
        ordered = self._sort(waiting, cache, running, now)
        # A ChunkCache never stores a prompt: holding a sibling would only serialise the group.
        if not self.params.in_batch_dedup or isinstance(cache, ChunkCache):
            return PolicyResult(ordered)
        kept, held = hold_in_batch_duplicates(ordered, cache, matches_fresh=self.cache_aware)
        return PolicyResult(kept, held)

    @abstractmethod
    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]: ...


class FCFSPolicy(BaseSchedulePolicy):
    """First come, first served: the queue's own order (retracted requests are at its front)."""

    name = "fcfs"

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        return list(waiting)


class LPMPolicy(BaseSchedulePolicy):
    """Longest prefix match: most cached tokens first, ties in arrival order."""

    name = "lpm"
    cache_aware = True

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        return sorted(waiting, key=lambda r: -r.match_len)


class DFSWeightPolicy(LPMPolicy):
    """Subtree by subtree: heaviest subtree (most waiting requests below it) first, admitted together.

    Needs the radix tree; on any other cache it falls back to lpm order and
    counts it in ``fallbacks`` (logged once).
    """

    name = "dfs-weight"

    def __init__(self, params: SchedulePolicyParams) -> None:
        super().__init__(params)
        self.fallbacks = 0

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        if not isinstance(cache, RadixCache):
            if not self.fallbacks:
                logger.warning("dfs-weight needs a radix cache, not %s: using lpm order", type(cache).__name__)
            self.fallbacks += 1
            return super()._sort(waiting, cache, running, now)
        return dfs_weight_order(waiting, cache)


def dfs_weight_order(waiting: Sequence[Request], cache: RadixCache) -> list[Request]:
    """Pre-order walk over the nodes waiting requests end their match at.

    A node's weight is the number of waiting requests whose match ends in its
    subtree; children go heaviest first (ties: the one holding the earliest
    arrival). Requests attached to a node are emitted when it is reached, in
    queue order. Requests with no cached prefix (attached to the root) go last:
    they share nothing the cache can group. Costs O(sum of match depths in nodes).
    """
    weight: dict[TreeNode, int] = {}
    first: dict[TreeNode, int] = {}  # queue index of the earliest request in the subtree
    kids: dict[TreeNode, list[TreeNode]] = {}
    attached: dict[TreeNode, list[Request]] = {}
    for index, req in enumerate(waiting):
        last = cast(TreeNode, req.match_node)  # set by this round's match (order())
        attached.setdefault(last, []).append(req)
        node: TreeNode | None = last
        while node is not None:
            if node not in weight:
                weight[node], first[node] = 0, index
                if node.parent is not None:
                    kids.setdefault(node.parent, []).append(node)
            weight[node] += 1
            node = node.parent
    order: list[Request] = []
    stack = _by_weight(kids.get(cache.root, []), weight, first)
    while stack:
        node = stack.pop()
        order.extend(attached.get(node, ()))
        stack.extend(_by_weight(kids.get(node, []), weight, first))
    order.extend(attached.get(cache.root, ()))
    return order


def _by_weight(nodes: list[TreeNode], weight: dict[TreeNode, int], first: dict[TreeNode, int]) -> list[TreeNode]:
    """Lightest last-visited first: the stack pops the heaviest (earliest on ties) next."""
    return sorted(nodes, key=lambda n: (weight[n], -first[n]))


class LOFPolicy(BaseSchedulePolicy):
    """Longest output first: largest ``max_new_tokens`` first, ties in arrival order."""

    name = "lof"

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)


class RandomPolicy(BaseSchedulePolicy):
    """A fresh shuffle each round from a generator seeded once: reproducible per seed."""

    name = "random"

    def __init__(self, params: SchedulePolicyParams) -> None:
        super().__init__(params)
        self._rng = random.Random(params.seed)

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        order = list(waiting)
        self._rng.shuffle(order)
        return order


class RoutingKeyPolicy(BaseSchedulePolicy):
    """Requests whose ``routing_key`` is most frequent among the running ones first, then FCFS."""

    name = "routing-key"

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        counts: Counter[str | None] = Counter(r.routing_key for r in running if r.routing_key is not None)
        return sorted(waiting, key=lambda r: -counts[r.routing_key])  # None, or unseen: 0


class PriorityPolicy(BaseSchedulePolicy):
    """Higher ``priority`` first, arrival order within a priority."""

    name = "priority"

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        return sorted(waiting, key=lambda r: -r.priority)


class HRRNPolicy(BaseSchedulePolicy):
    """Highest response ratio next: (wait + service) / service, service estimated from uncached tokens.

    Cache-aware like lpm (a warm request has a short service, so its ratio
    climbs fast), but a cold request's ratio grows with its wait without bound,
    so a stream of warm requests cannot starve it.
    """

    name = "hrrn"
    cache_aware = True

    def _sort(
        self, waiting: Sequence[Request], cache: BasePrefixCache, running: Sequence[Request], now: float
    ) -> list[Request]:
        return sorted(waiting, key=lambda r: -self.response_ratio(r, now))

    def service_s(self, req: Request) -> float:
        """Estimated seconds of work: uncached prefill plus the whole decode budget."""
        uncached_len = len(req.fill_ids) - req.match_len
        service = uncached_len / HRRN_PREFILL_RATE + req.params.max_new_tokens / HRRN_DECODE_RATE
        return max(service, MIN_SERVICE_S)

    def response_ratio(self, req: Request, now: float) -> float:
        service = self.service_s(req)
        return (max(now - req.arrival_time, 0.0) + service) / service


_REGISTRY: dict[str, type[BaseSchedulePolicy]] = {
    cls.name: cls
    for cls in (
        FCFSPolicy,
        LPMPolicy,
        DFSWeightPolicy,
        LOFPolicy,
        RandomPolicy,
        RoutingKeyPolicy,
        PriorityPolicy,
        HRRNPolicy,
    )
}
assert tuple(_REGISTRY) == SCHEDULE_POLICIES


def create_schedule_policy(
    name: str,
    in_batch_dedup: bool = True,
    seed: int = 0,
) -> BaseSchedulePolicy:
    """The policy named by ``--schedule-policy``; unknown names raise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {SCHEDULE_POLICIES}")
    return _REGISTRY[name](SchedulePolicyParams(in_batch_dedup, seed))
