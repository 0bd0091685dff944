"""What the dashboard polls (``GET /dashboard/data``): the loop's figures now, as plain data.

Counters only grow (the page turns two polls into rates: hit rate = d cached / d prompt tokens,
tokens/s = d generated / d ``time``); gauges are the state now. Token ids only: the server decodes
a prefix's head for a viewer who may read it. With ``visible`` (a tenant's view), the tree and the
request timeline keep only the namespaces it accepts; the pool-wide figures stay (``/server_info``
shows them to every caller). Call it on the loop's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixserve.cache.hot_tree import hot_subtrees
from radixserve.cache.tiers.build import UNBOUNDED_BYTES
from radixserve.cache.tiers.index import TierIndex
from radixserve.scheduler.loop import Scheduler
from radixserve.scheduler.stats import RequestTiming

Visible = Callable[[str | None], bool]


def live_view(scheduler: Scheduler, tree_nodes: int = 0, visible: Visible | None = None) -> dict[str, Any]:
    """Counters, load, pool, tiers, evictions, the last requests (oldest first), and ``tree_nodes``
    of the hottest subtrees (0: no tree walk; None for a cache that is not a radix tree)."""
    cache, stats = scheduler.cache, scheduler.stats
    allocator = cache.allocator
    now = time.perf_counter()
    cached = cache.total_size()
    tiers = cache.tiers
    return {
        "time": now,
        "totals": {**stats.snapshot(), "evicted_tokens": cache.evicted_tokens},
        "load": {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "token_usage": scheduler.token_usage(),
        },
        "pool": {
            "pool_tokens": allocator.size,
            "free_tokens": allocator.free_size(),
            "cached_tokens": cached,
            "evictable_tokens": cache.evictable_size(),
            "protected_tokens": cache.protected_size(),
            "live_request_tokens": allocator.size - allocator.free_size() - cached,
        },
        "tiers": None if tiers is None else tier_view(tiers),
        "evictions": evictions(scheduler),
        "requests": [timing_view(t, now) for t in stats.recent if visible is None or visible(t.extra_key)],
        "tree": hot_subtrees(cache, tree_nodes, visible) if tree_nodes > 0 else None,
    }


def tier_view(tiers: TierIndex) -> dict[str, Any]:
    """Each tier below the pool: what it holds (capacity None: unbounded) and its traffic counters (bytes and
    tokens since start)."""
    out: dict[str, Any] = {}
    stats = tiers.stats
    for name, store in (("host", tiers.host), ("disk", tiers.disk)):
        if store is None:
            continue
        out[name] = {
            "pages": len(store),
            "used_bytes": store.used_bytes,
            "capacity_bytes": None if store.capacity_bytes >= UNBOUNDED_BYTES else store.capacity_bytes,
            "hit_tokens": stats.hit_tokens[name],
            "loaded_bytes": stats.bytes_loaded[name],
            "stored_bytes": stats.bytes_stored[name],
        }
    return out


def evictions(scheduler: Scheduler) -> list[dict[str, Any]]:
    """What each tier evicted since start, under which policy: the pool's tree policy (tokens), then the
    host tier's and the disk tier's least-recently-used orders (pages)."""
    cache = scheduler.cache
    out = [
        {
            "tier": "device",
            "policy": getattr(cache, "eviction_policy", "lru"),
            "unit": "tokens",
            "evicted": cache.evicted_tokens,
        }
    ]
    tiers = cache.tiers
    if tiers is not None and tiers.host is not None:
        out.append({"tier": "host", "policy": "lru", "unit": "pages", "evicted": tiers.stats.host_evicted_pages})
    if tiers is not None and tiers.disk is not None:
        out.append({"tier": "disk", "policy": "lru", "unit": "pages", "evicted": tiers.disk.stats.evicted})
    return out


def timing_view(timing: RequestTiming, now: float) -> dict[str, Any]:
    """One finished request's phases, as seconds before ``now`` (None: it never reached that phase)."""

    def ago(moment: float | None) -> float | None:
        return None if moment is None else round(now - moment, 4)

    return {
        "rid": timing.rid,
        "arrival_ago_s": ago(timing.arrival),
        "admitted_ago_s": ago(timing.admitted),
        "first_token_ago_s": ago(timing.first_token),
        "finish_ago_s": ago(timing.finish),
        "prompt_tokens": timing.prompt_tokens,
        "cached_tokens": timing.cached_tokens,
        "output_tokens": timing.output_tokens,
        "finish_reason": timing.finish_reason,
    }
