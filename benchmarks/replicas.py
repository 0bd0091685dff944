"""Many replicas behind a router, simulated: ``radixserve bench simulate --replicas 8,32 --router ...``.

For scale we cannot run here. Each replica is a real RadixCache with its own
capacity (``--capacity-fraction`` of the workload's working set, per replica)
and a FIFO queue; requests arrive evenly at a rate that keeps the cluster
``utilization`` busy if nothing were cached; a request's service time is its
uncached prompt at ``prefill_rate`` plus its output at ``decode_rate`` tokens/s.
A replica's load is the requests routed to it and not yet finished.

Routers: ``round-robin``; ``power-of-two`` (two random replicas, the less
loaded); ``cache-aware`` (the router's own approximate index of what it routed
where, ``router.choice.PrefixIndex``, then ``choose_replica``);
``cache-aware-precise`` (the replicas' real caches, as KV events would give it).
Simplification: a request's prefix is cached on its replica as soon as it is
routed (a real replica caches it when prefilled).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.simulate import TokenCounts
from benchmarks.workloads import TraceRequest
from radixserve.cache import RadixCache, RadixKey
from radixserve.extras import missing_extra
from radixserve.memory import TokenAllocator
from radixserve.router.choice import PrefixIndex, RouterConfig, choose_replica

ROUTERS = ("round-robin", "power-of-two", "cache-aware", "cache-aware-precise")


@dataclass
class ReplicaResult(TokenCounts):
    router: str
    replicas: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    load_imbalance: float  # max / mean requests per replica
    peak_queue: int  # the longest any replica's queue got

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "hit_rate": self.hit_rate, "prefill_tokens": self.prefill_tokens}


def simulate_replicas(
    requests: Sequence[TraceRequest],
    num_replicas: int,
    router: str,
    capacity: int,
    *,
    utilization: float = 0.8,
    prefill_rate: float = 5000.0,
    decode_rate: float = 50.0,
    config: RouterConfig = RouterConfig(),
    seed: int = 0,
) -> ReplicaResult:
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose from {ROUTERS}")
    caches = [RadixCache(TokenAllocator(capacity)) for _ in range(num_replicas)]
    index = [PrefixIndex(capacity) for _ in range(num_replicas)] if router == "cache-aware" else []
    rng = random.Random(seed)
    cold = [len(r.prompt) / prefill_rate + len(r.output) / decode_rate for r in requests]
    interval = float(np.mean(cold)) / (num_replicas * utilization)
    pending: list[deque[float]] = [deque() for _ in range(num_replicas)]  # finish times, in order
    busy_until = [0.0] * num_replicas
    routed = [0] * num_replicas
    prompt_tokens = cached_tokens = peak = 0
    for i, request in enumerate(requests):
        now = i * interval
        for queue in pending:
            while queue and queue[0] <= now:
                queue.popleft()
        loads = [len(queue) for queue in pending]
        if router == "round-robin":
            target = i % num_replicas
        elif router == "power-of-two":
            a, b = rng.sample(range(num_replicas), 2) if num_replicas > 1 else (0, 0)
            target = a if loads[a] <= loads[b] else b
        else:
            key = RadixKey(request.prompt, request.extra_key)
            matches = (
                [entry.match(key) for entry in index]
                if index
                else [len(cache.match_prefix(key).indices) for cache in caches]
            )
            target = choose_replica(matches, loads, len(request.prompt), config, turn=i)
        hit = _serve(caches[target], request)
        if index:
            index[target].add(RadixKey(request.prompt, request.extra_key))
        start = max(now, busy_until[target])
        busy_until[target] = start + (len(request.prompt) - hit) / prefill_rate + len(request.output) / decode_rate
        pending[target].append(busy_until[target])
        routed[target] += 1
        peak = max(peak, len(pending[target]))
        prompt_tokens += len(request.prompt)
        cached_tokens += hit
    imbalance = max(routed) / (sum(routed) / num_replicas) if requests else 1.0
    return ReplicaResult(router, num_replicas, len(requests), prompt_tokens, cached_tokens, imbalance, peak)


def _serve(cache: RadixCache, request: TraceRequest) -> int:
    """Match, compute the rest, cache the whole turn; the matched length (0 if it cannot fit)."""
    req = cache.open_request(RadixKey(request.prompt, request.extra_key))
    hit = len(req.token_ids)
    if cache.extend_request(req, np.concatenate([request.prompt[hit:], request.output])):
        cache.cache_finished_req(req)
        return hit
    cache.cache_finished_req(req, is_insert=False)
    return 0


def format_replica_table(results: Sequence[ReplicaResult]) -> str:
    lines = [
        f"{'replicas':>8} {'router':<20} {'hit rate':>8} {'prefill tokens':>15} {'imbalance':>9} {'peak queue':>10}"
    ]
    for r in results:
        lines.append(
            f"{r.replicas:>8} {r.router:<20} {r.hit_rate:>8.1%} {r.prefill_tokens:>15,} "
            f"{r.load_imbalance:>9.2f} {r.peak_queue:>10}"
        )
    return "\n".join(lines)


def plot_replicas(results: Sequence[ReplicaResult], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise missing_extra("bench", "a plot") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hits, balance) = plt.subplots(1, 2, figsize=(10, 4))
    for router in dict.fromkeys(r.router for r in results):
        rows = sorted((r for r in results if r.router == router), key=lambda r: r.replicas)
        xs = [r.replicas for r in rows]
        hits.plot(xs, [r.hit_rate * 100 for r in rows], marker="o", label=router)
        balance.plot(xs, [r.load_imbalance for r in rows], marker="o", label=router)
    for ax, label in ((hits, "token hit rate (%)"), (balance, "load imbalance (max / mean)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    hits.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
