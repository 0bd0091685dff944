"""Cost of the cache operations themselves: ``python -m benchmarks.cache_ops``.

Part 1, growth with cache size: a cache holding N cached requests (a shared
2,055-token prefix, each with its own 32-token tail), for N = 1k, 10k, 100k.
Median microseconds of
  match   a hot 2,055-token prefix (followed by 50 uncached tokens),
  insert  a new 2,000-token branch below that prefix,
  evict   300 tokens (the tree is topped up again between repeats, untimed).
Flat rows mean the cost does not grow with N.

Part 2, a support-agent stream (512-token system prompt + 1,543-token few-shot
block + interleaved multi-turn conversations) replayed with up to 16 requests
in flight: per request, match + lock + allocate (evicting when short) + insert
+ unlock, timed together. Seeded: the same figures' inputs on every run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import VOCAB_SIZE, TraceRequest, support_agent
from radixserve.cache import BasePrefixCache, CacheReq, RadixKey, create_prefix_cache
from radixserve.memory import TokenAllocator

VARIANTS: dict[str, tuple[str, int]] = {"radix-p1": ("radix", 1), "radix-p16": ("radix", 16), "block-16": ("block", 16)}
POLICIES = {"radix-adaptive-p1": ("radix", 1, "adaptive")}  # opt-in rows: another eviction policy than LRU
PREFIX_LEN, TAIL_LEN = 2055, 32


@dataclass(frozen=True)
class GrowthResult:
    variant: str
    num_requests: int
    match_us: float
    insert_us: float
    evict_us: float


@dataclass(frozen=True)
class ReplayResult:
    variant: str
    num_requests: int
    median_us: float
    p99_us: float
    hit_rate: float


def make_cache(variant: str, pool_tokens: int) -> BasePrefixCache:
    kind, page_size, policy = POLICIES.get(variant, (*VARIANTS.get(variant, (variant, 1)), "lru"))
    pool_tokens -= pool_tokens % 16
    allocator = TokenAllocator(pool_tokens, page_size if kind == "radix" else 1)
    return create_prefix_cache(kind, allocator, page_size, policy)


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000


def _serve(cache: BasePrefixCache, prompt: np.ndarray) -> None:
    req = cache.open_request(RadixKey(prompt))
    if not cache.extend_request(req, prompt[req.cache_protected_len :]):
        raise RuntimeError("benchmark pool too small")
    cache.cache_finished_req(req)


def measure_growth(variant: str, num_requests: int, repeat: int, seed: int = 0) -> GrowthResult:
    rng = np.random.default_rng(seed)

    def fresh(n: int) -> np.ndarray:
        return rng.integers(1, VOCAB_SIZE, size=n, dtype=np.int64)

    prefix = fresh(PREFIX_LEN)
    cache = make_cache(variant, PREFIX_LEN + (num_requests + 40 * repeat) * TAIL_LEN + 2100 * repeat)
    for _ in range(num_requests):
        _serve(cache, np.concatenate([prefix, fresh(TAIL_LEN)]))

    match_ns = []
    for _ in range(repeat):
        key = RadixKey(np.concatenate([prefix, fresh(50)]))
        t0 = time.perf_counter_ns()
        cache.match_prefix(key)
        match_ns.append(time.perf_counter_ns() - t0)

    insert_ns = []
    for _ in range(repeat):
        key = RadixKey(np.concatenate([prefix, fresh(2000)]))
        key = key[: len(key) - len(key) % cache.page_size]
        slots = cache.allocator.alloc(len(key))
        assert slots is not None
        t0 = time.perf_counter_ns()
        already = cache.insert(key, slots)
        insert_ns.append(time.perf_counter_ns() - t0)
        cache.allocator.free(slots[:already])

    evict_ns = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        evicted = cache.evict(300)
        evict_ns.append(time.perf_counter_ns() - t0)
        for _ in range(-(-evicted // TAIL_LEN)):  # top the tree back up to N requests
            _serve(cache, np.concatenate([prefix, fresh(TAIL_LEN)]))
    return GrowthResult(variant, num_requests, _median_us(match_ns), _median_us(insert_ns), _median_us(evict_ns))


def replay(variant: str, requests: list[TraceRequest], pool_tokens: int, window: int = 16) -> ReplayResult:
    """Replay ``requests`` with up to ``window`` in flight; time every cache call per request."""
    cache = make_cache(variant, pool_tokens)
    per_request = [0] * len(requests)
    live: list[tuple[int, CacheReq]] = []
    prompt_tokens = cached_tokens = 0

    def finish(index: int, req: CacheReq) -> None:
        t0 = time.perf_counter_ns()
        cache.cache_finished_req(req)
        per_request[index] += time.perf_counter_ns() - t0

    for index, request in enumerate(requests):
        if len(live) == window:
            finish(*live.pop(0))
        t0 = time.perf_counter_ns()
        req = cache.open_request(RadixKey(request.prompt, request.extra_key))
        cached = req.cache_protected_len
        ok = cache.extend_request(req, request.prompt[cached:]) and cache.extend_request(req, request.output)
        per_request[index] += time.perf_counter_ns() - t0
        if not ok:
            raise RuntimeError(f"pool of {pool_tokens} tokens cannot hold {window} requests in flight")
        live.append((index, req))
        prompt_tokens += len(request.prompt)
        cached_tokens += cached
    for index, req in live:
        finish(index, req)
    cache.check_invariants()
    samples = sorted(per_request)
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1000
    return ReplayResult(variant, len(requests), _median_us(per_request), p99, cached_tokens / max(prompt_tokens, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench cache-ops", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="numbers of cached requests N")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"from {list(VARIANTS) + list(POLICIES)} and 'none'"
    )
    parser.add_argument("--repeat", type=int, default=50, help="timed repeats per operation")
    parser.add_argument("--users", type=int, default=200, help="support-agent users in the replay")
    parser.add_argument("--pool-tokens", type=int, default=200_000, help="KV pool size for the replay")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")

    print("Cache operation cost vs cached requests N (median us)")
    print(f"{'variant':<10} {'N':>8} {'match 2055':>11} {'insert 2000':>12} {'evict 300':>10}")
    for variant in (v for v in variants if v != "none"):
        for size in (int(s) for s in args.sizes.split(",")):
            g = measure_growth(variant, size, args.repeat)
            print(f"{g.variant:<10} {g.num_requests:>8} {g.match_us:>11.1f} {g.insert_us:>12.1f} {g.evict_us:>10.1f}")

    trace = support_agent(num_users=args.users)
    print(f"\nSupport-agent replay: {len(trace)} requests, pool {args.pool_tokens} tokens, 16 in flight")
    print(f"{'variant':<10} {'median us/req':>14} {'p99 us/req':>11} {'token hit rate':>15}")
    for variant in variants:
        r = replay(variant, trace, args.pool_tokens)
        print(f"{r.variant:<10} {r.median_us:>14.1f} {r.p99_us:>11.1f} {r.hit_rate:>15.1%}")


if __name__ == "__main__":
    main()
