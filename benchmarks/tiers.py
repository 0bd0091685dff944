"""``radixserve bench tiers``: what the host (L2) and disk (L3) cache tiers buy on a real model.

Three measurements on the embedded SmolLM2 (or ``--model-path``), offline engine, one thread:

- costs: per token, recomputing a ``--prefix-len`` prompt vs loading it back from L2 and from
  L3 (fetch, checksum, copy into the pool), median of ``--rounds``;
- rag: documents in Zipf order, a working set ``--docs`` x ``--doc-len`` at least 4x the pool;
  prompt tokens computed and TTFT p50 / p90 without tiers vs with (L2 = 2x the pool, L3 on);
  requests alternate between the two engines so machine load hits both alike;
- restart: TTFT of the first request sharing a ``--prefix-len`` prefix after a restart on the
  same ``--cache-dir`` vs the same request on a cold engine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from radixserve.cache import RadixKey
from radixserve.engine import Engine
from radixserve.memory.kv_pool import KVPool

ONE = {"max_new_tokens": 1, "temperature": 0}


def make(args: argparse.Namespace, pool: int, **tiers: Any) -> Engine:
    engine = Engine.create(model_path=args.model_path, max_total_tokens=pool, chunked_prefill_size=8192, **tiers)
    engine.generate(input_ids=[100, 101, 102], sampling_params=ONE)  # first-call warm-up, not measured
    return engine


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    result = engine.generate(input_ids=prompt, sampling_params=ONE)
    return time.perf_counter() - start, result.cached_tokens


def timed_load(engine: Engine, prompt: np.ndarray) -> tuple[float, int]:
    """Seconds to bring ``prompt``'s cached pages back from the lower tiers into the pool, and the tokens."""
    engine.cache.evict(engine.cache.evictable_size())
    start = time.perf_counter()
    req = engine.cache.open_request(RadixKey(prompt))
    seconds = time.perf_counter() - start
    engine.cache.cache_finished_req(req, is_insert=False)
    return seconds, len(req.token_ids)


def costs(args: argparse.Namespace, rng: np.random.Generator, folder: Path) -> dict[str, float]:
    engine = make(args, 2 * args.prefix_len, hicache_size=1.0, cache_dir=str(folder / "costs"))
    tiers = engine.cache.tiers
    assert tiers is not None and tiers.host is not None and tiers.disk is not None
    rows: dict[str, list[float]] = {"recompute": [], "host": [], "disk": []}
    for _ in range(args.rounds):
        prompt = rng.integers(100, engine.loaded.config.vocab_size - 100, args.prefix_len)
        seconds, _ = ttft(engine, prompt.tolist())
        rows["recompute"].append(seconds / args.prefix_len)
        seconds, tokens = timed_load(engine, prompt[:-1])  # L1 evicted -> demoted to L2 -> loaded back
        rows["host"].append(seconds / tokens)
        engine.cache.flush_to_disk()  # type: ignore[attr-defined]
        assert tiers.disk.flush(120)
        tiers.host.clear()
        seconds, tokens = timed_load(engine, prompt[:-1])
        rows["disk"].append(seconds / tokens)
    engine.close()
    out = {f"{name}_us_per_token": 1e6 * statistics.median(values) for name, values in rows.items()}
    for tier in ("host", "disk"):
        out[f"{tier}_speedup"] = out["recompute_us_per_token"] / out[f"{tier}_us_per_token"]
    return out


def rag(args: argparse.Namespace, rng: np.random.Generator, folder: Path) -> dict[str, Any]:
    pool = args.docs * args.doc_len // 4
    plain = make(args, pool)
    cfg = plain.loaded.config
    kv_bytes = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, plain.kv_pool.dtype)
    tiered = make(args, pool, hicache_size=2 * pool * kv_bytes / 2**30, cache_dir=str(folder / "rag"))
    vocab = cfg.vocab_size
    docs = [rng.integers(100, vocab - 100, args.doc_len).tolist() for _ in range(args.docs)]
    weights = 1.0 / np.arange(1, args.docs + 1) ** 1.1
    picks = rng.choice(args.docs, size=args.requests, p=weights / weights.sum())
    times: dict[str, list[float]] = {"without": [], "with": []}
    for doc in picks:
        prompt = docs[doc] + rng.integers(100, vocab - 100, 16).tolist()
        for name, engine in (("without", plain), ("with", tiered)):
            times[name].append(ttft(engine, prompt)[0])
    out: dict[str, Any] = {"pool_tokens": pool, "working_set_tokens": args.docs * args.doc_len}
    for name, engine in (("without", plain), ("with", tiered)):
        ms = sorted(1000 * t for t in times[name])
        out[name] = {
            "prompt_tokens_computed": engine.scheduler.stats.prefill_tokens,
            "ttft_p50_ms": ms[len(ms) // 2],
            "ttft_p90_ms": ms[int(len(ms) * 0.9)],
        }
    assert tiered.cache.tiers is not None
    out["with"]["tier_hit_tokens"] = dict(tiered.cache.tiers.stats.hit_tokens)
    tiered.close()
    return out


def restart(args: argparse.Namespace, rng: np.random.Generator, folder: Path) -> dict[str, float]:
    vocab_top = 49152 - 100
    prefix = rng.integers(100, vocab_top, args.prefix_len).tolist()
    first = make(args, 4 * args.prefix_len, cache_dir=str(folder / "restart"))
    ttft(first, prefix + rng.integers(100, vocab_top, 16).tolist())
    first.close()
    del first
    question = rng.integers(100, vocab_top, 16).tolist()
    warm = make(args, 4 * args.prefix_len, cache_dir=str(folder / "restart"))
    warm_s, cached = ttft(warm, prefix + question)
    warm.close()
    cold = make(args, 4 * args.prefix_len)
    cold_s, _ = ttft(cold, prefix + question)
    return {"cold_ttft_ms": 1000 * cold_s, "restart_ttft_ms": 1000 * warm_s, "cached_tokens": cached}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench tiers", description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--parts", default="costs,rag,restart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench-results/tiers.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="radixserve-tiers-"))
    results: dict[str, Any] = {}
    try:
        for part in args.parts.split(","):
            results[part] = {"costs": costs, "rag": rag, "restart": restart}[part](args, rng, folder)
            print(part, json.dumps(results[part], indent=1), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))
