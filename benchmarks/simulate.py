"""``radixserve bench simulate``: replay a workload through the prefix caches alone, against the optimum.

No model runs: each request opens (match + lock its cached prefix), gets slots
for the rest of its prompt and its output, and after ``--concurrency`` later
requests have started it finishes (its whole sequence is inserted, its lock
released). When the pool is short even after eviction, the request waits for
the oldest in-flight one to finish, then matches again (that one may have just
cached its prefix), as a server's waiting queue would; a request larger than
the whole pool is rejected (counted, never cached).

Caches compared at each capacity (tokens, or a fraction of the working set:
every distinct token position of every prompt + output): RadixCache under each
eviction policy at page size 1 and 16 (``radix-<policy>-p<page>``), the
vLLM-style BlockHashCache (``block-16``), no cache (``none``), and Belady's
offline optimum (``belady``, see ``belady.py``): an upper bound on the token hit
rate any online policy can reach at that capacity (and, asked by name, the
oracles that know only *whether* a leaf is read again: ``belady.ORACLES``). Printed per capacity: token
hit rate, prompt tokens computed (prefill), tokens evicted, µs of cache work per
request (this thread's CPU time, so other processes' load does not move it),
and the gap to the bound; then the adaptive policy against the best fixed one,
with its CPU per request over LRU's (``policy_table.py``); a PNG plots hit rate
against capacity.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.belady import ORACLES, BeladyCache, FutureIndex
from benchmarks.policy_table import online_summaries
from benchmarks.tier_sim import make_tiered_cache
from benchmarks.traces import load_scaled_trace, load_trace, time_slice, working_set_tokens
from benchmarks.workloads import TraceRequest, make_workload
from radixserve.cache import EVICTION_POLICIES, BasePrefixCache, CacheReq, RadixKey, create_prefix_cache
from radixserve.extras import missing_extra
from radixserve.memory import TokenAllocator

DEFAULT_CACHES = tuple(
    [f"radix-{policy}-p1" for policy in EVICTION_POLICIES]
    + [f"radix-{policy}-p16" for policy in ("lru", "slru", "lfu", "adaptive")]
    + ["block-16", "none", "belady"]
)
DEFAULT_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)


class TokenCounts:
    """Hit rate and prefill tokens from a result's prompt and cached token counts."""

    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class SimResult(TokenCounts):
    cache: str
    capacity: int  # KV slots (tokens)
    capacity_fraction: float  # of the working set
    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    evicted_tokens: int
    cache_seconds: float  # CPU time inside cache operations
    tier_hit_tokens: dict[str, int] | None = None  # tiered caches: of cached_tokens, loaded from host / disk

    @property
    def us_per_request(self) -> float:
        return self.cache_seconds / max(self.requests, 1) * 1e6

    def to_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "hit_rate": self.hit_rate,
            "prefill_tokens": self.prefill_tokens,
            "us_per_request": self.us_per_request,
        }


def make_cache(name: str, capacity: int, clock: list[float], index: FutureIndex | None) -> BasePrefixCache:
    """A cache by its table name, over a pool of ``capacity`` slots; ``clock[0]`` is the request index,
    ``clock[1]`` the time the online caches see (the index again, or the trace's timestamp)."""

    def now() -> float:
        return float(clock[1])

    if name in ORACLES:
        assert index is not None, f"{name} needs the future"
        return BeladyCache(TokenAllocator(capacity), index, lambda: float(clock[0]), ORACLES[name])
    if name == "none":
        return create_prefix_cache("none", TokenAllocator(capacity))
    kind, _, rest = name.partition("-")
    if kind == "block" and rest.isdigit():
        return create_prefix_cache("block", TokenAllocator(capacity), int(rest), clock=now)
    policy, _, page = rest.rpartition("-p")
    if kind == "tiered" and policy in EVICTION_POLICIES and page.isdigit():
        return make_tiered_cache(policy, int(page), capacity, now)
    if kind == "radix" and policy in EVICTION_POLICIES and page.isdigit():
        size = capacity - capacity % int(page)
        return create_prefix_cache("radix", TokenAllocator(size, int(page)), int(page), policy, clock=now)
    raise ValueError(
        f"unknown cache {name!r}: radix-<policy>-p<page>, tiered-<policy>-p<page>, block-<size>, none, "
        f"{' or '.join(ORACLES)}"
    )


def replay(
    requests: Sequence[TraceRequest],
    cache_name: str,
    capacity: int,
    concurrency: int = 16,
    index: FutureIndex | None = None,
    working_set: int | None = None,
    trace_clock: bool = False,
    factory: Callable[[list[float]], BasePrefixCache] | None = None,
) -> SimResult:
    """One cache over ``requests``; ``trace_clock``: the requests' timestamps are the cache's clock (a
    production trace: time-aware policies see its real gaps), else the request index. ``factory``: builds the
    cache instead of ``make_cache`` (given the clock list; when_signal.py's instrumented LRU)."""
    clock: list[float] = [0, 0]
    cache = make_cache(cache_name, capacity, clock, index) if factory is None else factory(clock)
    window: deque[CacheReq] = deque()
    prompt_tokens = cached_tokens = rejected = 0
    elapsed = 0.0
    for i, request in enumerate(requests):
        clock[0] = i
        clock[1] = request.timestamp if trace_clock and request.timestamp is not None else i
        prompt_tokens += len(request.prompt)
        start = time.thread_time()
        if len(window) >= concurrency:
            cache.cache_finished_req(window.popleft())
        while True:
            kv = cache.open_request(RadixKey(request.prompt, request.extra_key))
            matched = len(kv.token_ids)
            if cache.extend_request(kv, np.concatenate([request.prompt[matched:], request.output])):
                window.append(kv)
                cached_tokens += matched
                break
            # No room: wait for the oldest in-flight request, then match again (it may have
            # just cached this prompt's prefix), as a server's waiting queue would.
            cache.cache_finished_req(kv, is_insert=False)
            if not window:  # alone and still too big: the pool can never hold it
                rejected += 1
                break
            cache.cache_finished_req(window.popleft())
        elapsed += time.thread_time() - start
    start = time.thread_time()
    while window:
        cache.cache_finished_req(window.popleft())
    elapsed += time.thread_time() - start
    assert cache.protected_size() == 0
    assert cache.allocator.free_size() + cache.total_size() == cache.allocator.size, f"{cache_name} leaked slots"
    fraction = capacity / working_set if working_set else float("nan")
    return SimResult(
        cache_name,
        capacity,
        fraction,
        len(requests),
        rejected,
        prompt_tokens,
        cached_tokens,
        cache.evicted_tokens,
        elapsed,
        dict(cache.tiers.stats.hit_tokens) if cache.tiers is not None else None,
    )


def future_index(requests: Sequence[TraceRequest]) -> FutureIndex:
    return FutureIndex([(r.extra_key, r.prompt) for r in requests])


def simulate(
    requests: Sequence[TraceRequest],
    caches: Sequence[str],
    capacities: Sequence[int],
    concurrency: int = 16,
    repeat: int = 1,
    trace_clock: bool = False,
) -> list[SimResult]:
    """Every cache at every capacity; the future index is built once, only if an oracle (belady) is asked.

    ``repeat``: replay each cache that many times in a row and keep the least CPU time
    (the hit counts are the same every time: a replay is deterministic).
    """
    working_set = working_set_tokens(list(requests))
    index = future_index(requests) if ORACLES.keys() & set(caches) else None
    return [
        min(
            (
                replay(requests, name, capacity, concurrency, index, working_set, trace_clock)
                for _ in range(max(repeat, 1))
            ),
            key=lambda r: r.cache_seconds,
        )
        for capacity in capacities
        for name in caches
    ]


def format_table(results: Sequence[SimResult]) -> str:
    lines = []
    for capacity in sorted({r.capacity for r in results}):
        rows = [r for r in results if r.capacity == capacity]
        bound = next((r.hit_rate for r in rows if r.cache == "belady"), None)
        lines.append(
            f"\ncapacity {capacity:,} tokens ({rows[0].capacity_fraction:.0%} of the working set), "
            f"{rows[0].requests:,} requests"
        )
        lines.append(
            f"{'cache':<18} {'hit rate':>8} {'prefill tokens':>15} {'evicted':>12} {'µs/req':>8} "
            f"{'gap to bound':>12} {'rejected':>8}"
        )
        for r in sorted(rows, key=lambda r: -r.hit_rate):
            gap = "" if bound is None or r.cache == "belady" else f"{(bound - r.hit_rate) * 100:+.1f} pt"
            name = "belady (bound)" if r.cache == "belady" else r.cache
            tiers = ""
            if r.tier_hit_tokens is not None and r.prompt_tokens:
                l1 = r.cached_tokens - sum(r.tier_hit_tokens.values())
                split = [l1, r.tier_hit_tokens["host"], r.tier_hit_tokens["disk"]]
                tiers = "  L1 {:.1%} / L2 {:.1%} / L3 {:.1%}".format(*(n / r.prompt_tokens for n in split))
            lines.append(
                f"{name:<18} {r.hit_rate:>8.1%} {r.prefill_tokens:>15,} {r.evicted_tokens:>12,} "
                f"{r.us_per_request:>8.0f} {gap:>12} {r.rejected:>8}{tiers}"
            )
    return "\n".join(lines)


def plot(results: Sequence[SimResult], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise missing_extra("bench", "a plot") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    policies = sorted({name.split("-")[1] for name in (r.cache for r in results) if name.startswith("radix-")})
    for name in dict.fromkeys(r.cache for r in results):
        if name == "none":
            continue  # 0% everywhere: said in the title
        rows = sorted((r for r in results if r.cache == name), key=lambda r: r.capacity)
        xs, ys = [r.capacity_fraction * 100 for r in rows], [r.hit_rate * 100 for r in rows]
        if name == "belady":
            ax.plot(xs, ys, "k--", linewidth=2.5, label="Belady (offline bound)")
        elif name.startswith("radix-"):
            color = colors[policies.index(name.split("-")[1]) % len(colors)]
            style = "-" if name.endswith("-p1") else ":"
            ax.plot(xs, ys, style, color=color, marker="o", markersize=3, linewidth=1.4, label=name)
        else:
            ax.plot(xs, ys, "-", color="0.5", marker="s", markersize=3, linewidth=2.5, alpha=0.6, label=name)
    ax.set_xlabel("KV capacity (% of the working set)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def simulate_cluster(
    requests: Sequence[TraceRequest],
    label: str,
    replica_counts: list[int],
    routers: list[str],
    capacity: int,
    out: Path,
) -> None:
    from benchmarks.replicas import format_replica_table, plot_replicas, simulate_replicas

    start = time.perf_counter()
    print(f"{len(requests):,} requests of {label}; {capacity:,} KV tokens per replica")
    results = [simulate_replicas(requests, n, router, capacity) for n in replica_counts for router in routers]
    print(format_replica_table(results))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"replicas-{label}"
    plot_replicas(
        results, str(out / f"{stem}.png"), f"{label}: {len(requests):,} requests, {capacity:,} tokens a replica"
    )
    (out / f"{stem}.json").write_text(json.dumps([r.to_dict() for r in results], indent=1))
    print(f"{len(results)} runs in {time.perf_counter() - start:.1f} s; wrote {out / stem}.png and .json")


def read_trace(spec: str, block_size: int, block_tokens: int, limit: int | None, part: str) -> list[TraceRequest]:
    """``--trace``: ``mooncake:PATH`` (scaled, ``load_scaled_trace``) or a PATH read as it is; then a time slice."""
    if spec.startswith("mooncake:"):
        requests = load_scaled_trace(spec.removeprefix("mooncake:"), block_tokens, block_size, limit)
    else:
        requests = load_trace(spec, block_size=block_size, limit=limit)
    return time_slice(requests, part)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve bench simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="support-agent", help="a workload name (see benchmarks/workloads.py)")
    parser.add_argument(
        "--trace",
        default=None,
        help="a JSONL trace file instead (Mooncake-style hash_ids or input_ids), replayed on its timestamps; "
        "mooncake:PATH scales each block to --block-tokens tokens (prompts only)",
    )
    parser.add_argument("--block-size", type=int, default=512, help="tokens per hash id in a trace file")
    parser.add_argument("--block-tokens", type=int, default=32, help="mooncake:PATH: tokens a block is scaled to")
    parser.add_argument(
        "--time-slice", default="all", choices=("all", "first-half", "second-half"), help="a trace's half, by time"
    )
    parser.add_argument("--num-requests", type=int, default=1000, help="at most this many (0: a whole trace)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--caches", default=",".join(DEFAULT_CACHES), help="comma-separated cache names")
    parser.add_argument(
        "--capacity-fraction",
        default=",".join(map(str, DEFAULT_FRACTIONS)),
        help="capacities as fractions of the working set",
    )
    parser.add_argument("--capacity-tokens", default=None, help="capacities in tokens (overrides the fractions)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (their tokens are locked)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="replay each cache this many times, keep the least CPU time per request"
    )
    parser.add_argument("--output-dir", default="bench-results", help="where the PNG and JSON go")
    parser.add_argument(
        "--replicas",
        default=None,
        help="simulate this many replicas behind each --router instead (e.g. 8,32,128); "
        "--capacity-fraction is then per replica (default 0.1)",
    )
    parser.add_argument(
        "--router", default="round-robin,power-of-two,cache-aware,cache-aware-precise", help="routers for --replicas"
    )
    return parser


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.trace:
        limit = args.num_requests or None  # 0: the whole trace
        requests = read_trace(args.trace, args.block_size, args.block_tokens, limit, args.time_slice)
        label = Path(args.trace.removeprefix("mooncake:")).name + (
            "" if args.time_slice == "all" else f"-{args.time_slice}"
        )
    else:
        requests = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed)
        label = args.workload
    working_set = working_set_tokens(requests)
    if args.replicas:
        fraction = (
            0.1
            if args.capacity_fraction == parser.get_default("capacity_fraction")
            else _floats(args.capacity_fraction)[0]
        )
        simulate_cluster(
            requests,
            label,
            [int(n) for n in _floats(args.replicas)],
            [r for r in args.router.split(",") if r],
            int(fraction * working_set),
            Path(args.output_dir),
        )
        return
    caches = [c for c in args.caches.split(",") if c]
    if args.capacity_tokens:
        capacities = [int(c) for c in _floats(args.capacity_tokens)]
    else:
        capacities = [max(int(f * working_set), 16) for f in _floats(args.capacity_fraction)]
    print(
        f"{label}: {len(requests):,} requests, {sum(len(r.prompt) for r in requests):,} prompt tokens, "
        f"working set {working_set:,} tokens, concurrency {args.concurrency}"
    )
    start = time.perf_counter()
    results = simulate(requests, caches, capacities, args.concurrency, args.repeat, trace_clock=bool(args.trace))
    print(format_table(results))
    print(online_summaries(results))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"simulate-{label}"
    plot(
        results,
        out / f"{stem}.png",
        f"{label}: {len(requests):,} requests, concurrency {args.concurrency} (no cache: 0% everywhere)",
    )
    (out / f"{stem}.json").write_text(json.dumps([r.to_dict() for r in results], indent=1))
    print(f"\n{len(results)} replays in {time.perf_counter() - start:.1f} s; wrote {out / stem}.png and .json")
