"""Which replica serves a request: the longest cached prefix, unless load is out of balance.

``choose_replica`` is a pure function of per-replica prefix-match lengths and
loads (the Ray Serve router and the simulator both call it):

1. load out of balance — max - min > ``abs_threshold`` *and* max > ``rel_threshold`` x min
   (both, as SGLang's router does): the least-loaded replica;
2. else the replica with the longest match, if that match covers at least
   ``min_match_fraction`` of the request; among equal matches, the least loaded;
3. else (nothing worth reusing) the least-loaded replica.

Ties are broken by rotation (``turn``), so equal replicas take turns instead of
replica 0 taking everything.

``PrefixIndex`` is a router's approximate view of one replica's cache: the
prefixes it routed there, in the project's own RadixCache (its "slots" are
placeholders), LRU-bounded like the replica's real cache. Namespaces never
match each other, exactly as in the replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.cache import RadixCache, RadixKey
from radixserve.memory import TokenAllocator


@dataclass(frozen=True)
class RouterConfig:
    abs_threshold: int = 8  # queued requests
    rel_threshold: float = 1.5
    min_match_fraction: float = 0.1  # a shorter match is not worth giving up balance for


def imbalanced(loads: Sequence[int], config: RouterConfig) -> bool:
    low, high = min(loads), max(loads)
    return high - low > config.abs_threshold and high > config.rel_threshold * low


def _least_loaded(candidates: Sequence[int], loads: Sequence[int], turn: int) -> int:
    low = min(loads[i] for i in candidates)
    ties = [i for i in candidates if loads[i] == low]
    return ties[turn % len(ties)]


def choose_replica(
    match_lens: Sequence[int], loads: Sequence[int], request_len: int, config: RouterConfig, turn: int = 0
) -> int:
    """The replica index for one request (see the module docstring)."""
    if not match_lens or len(match_lens) != len(loads):
        raise ValueError("one match length and one load per replica")
    everyone = range(len(loads))
    if imbalanced(loads, config):
        return _least_loaded(everyone, loads, turn)
    best = max(match_lens)
    if best > 0 and best >= config.min_match_fraction * request_len:
        return _least_loaded([i for i in everyone if match_lens[i] == best], loads, turn)
    return _least_loaded(everyone, loads, turn)


class PrefixIndex:
    """The prefixes routed to one replica, LRU-bounded at ``capacity`` tokens."""

    def __init__(self, capacity: int) -> None:
        self.cache = RadixCache(TokenAllocator(capacity))

    def match(self, key: RadixKey) -> int:
        return len(self.cache.match_prefix(key).indices)

    def add(self, key: RadixKey) -> None:
        """Remember ``key`` (evicting the least recently routed prefixes when full)."""
        key = key[: self.cache.allocator.size]
        req = self.cache.open_request(key)
        if self.cache.extend_request(req, key.token_ids[len(req.token_ids) :]):
            self.cache.cache_finished_req(req)
        else:
            self.cache.cache_finished_req(req, is_insert=False)
