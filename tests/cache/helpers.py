"""Small builders shared by the cache tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from radixserve.cache import BasePrefixCache, CacheReq, RadixKey

_fresh = itertools.count(1_000_000)


def tokens(n: int) -> list[int]:
    """``n`` tokens no other call returns: a fresh, unshared segment."""
    return [next(_fresh) for _ in range(n)]


def counter_clock() -> Callable[[], float]:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def start(cache: BasePrefixCache, token_ids: Sequence[int], extra_key: str | None = None) -> CacheReq:
    """A live request: cached prefix matched and locked, the rest allocated."""
    req = cache.open_request(RadixKey(token_ids, extra_key))
    assert cache.extend_request(req, np.asarray(token_ids[len(req.kv_indices) :])), "pool too small"
    return req


def serve(cache: BasePrefixCache, token_ids: Sequence[int], extra_key: str | None = None) -> int:
    """Run one request start to finish; return how many of its tokens were cached."""
    req = start(cache, token_ids, extra_key)
    cached = req.cache_protected_len
    cache.cache_finished_req(req)
    return cached
