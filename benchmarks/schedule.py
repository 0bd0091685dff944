"""What the scheduler saves: ``python -m radixserve bench schedule``.

For each schedule policy, on a tiny random Llama and on SmolLM2, replays
  burst          requests arriving together on a cold shared prefix (the chapter's 64 x 2,000)
  support-agent  system prompt + few-shot block + interleaved multi-turn conversations
through the offline engine and prints prompt tokens computed, token hit rate
and throughput. Then times one LPM scheduling round (matching every waiting
request against a populated cache, plus in-batch dedup) at 128, 1,000 and
5,000 waiting requests: LPM never switches itself off on a long queue.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.workloads import TraceRequest, fewshot_burst, support_agent
from radixserve.cache import RadixCache, RadixKey
from radixserve.core import SamplingParams
from radixserve.engine import Engine
from radixserve.memory import TokenAllocator
from radixserve.scheduler.policy import create_schedule_policy
from radixserve.scheduler.request import Request
from tests.support.tiny_model import build_engine_folder

POLICIES = ("fcfs", "lpm", "dfs-weight", "hrrn", "fcfs/no-dedup")  # the last: in-batch dedup off


def run_workload(model_path: str, label: str, trace: list[TraceRequest], max_new_tokens: int) -> str:
    policy, _, no_dedup = label.partition("/")
    engine = Engine.create(
        model_path=model_path,
        schedule_policy=policy,
        max_total_tokens=160_000,
        chunked_prefill_size=200_000,
        max_running_requests=64,
        in_batch_dedup=not no_dedup,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    results = engine.generate(input_ids=[r.prompt.tolist() for r in trace], sampling_params=params)
    elapsed = time.perf_counter() - t0
    stats = engine.scheduler.stats
    prompt_tokens = sum(len(r.prompt) for r in trace)
    cached = sum(r.cached_tokens for r in results)
    hit_rate = cached / prompt_tokens
    return (
        f"{label:<14} {stats.prefill_tokens:>15,} {hit_rate:>9.1%} {len(trace) / elapsed:>8.2f} "
        f"{len(trace) * max_new_tokens / elapsed:>10.1f}"
    )


def lpm_round_seconds(num_waiting: int, prompt_len: int = 2000, groups: int = 8, seed: int = 0) -> float:
    """One LPM ``order`` call over ``num_waiting`` requests against a cache holding their groups."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 49_000, prompt_len - 64) for _ in range(groups)]
    cache = RadixCache(TokenAllocator(groups * prompt_len + 4096))
    for prefix in prefixes:
        req = cache.open_request(RadixKey(prefix))
        assert cache.extend_request(req, prefix)
        cache.cache_finished_req(req)
    params = SamplingParams(max_new_tokens=16)
    waiting = [
        Request(i, np.concatenate([prefixes[i % groups], rng.integers(1, 49_000, 64)]), params)
        for i in range(num_waiting)
    ]
    policy = create_schedule_policy("lpm")
    t0 = time.perf_counter()
    policy.order(waiting, cache, [], time.perf_counter())
    return time.perf_counter() - t0


def scaled_workloads(vocab: int, small: bool) -> dict[str, tuple[list[TraceRequest], int]]:
    if small:  # SmolLM2 on a 2-core CPU: keep each run around a minute
        return {
            "burst 16 x (512 shared + 32)": (fewshot_burst(16, 512, 32, vocab), 8),
            "support-agent 6 users x 2 turns": (support_agent(6, 2, vocab_size=vocab), 8),
        }
    return {
        "burst 64 x (2,000 shared + 50)": (fewshot_burst(64, 2000, 50, vocab), 8),
        "support-agent 30 users x 3 turns": (support_agent(30, 3, vocab_size=vocab), 16),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench schedule", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="tiny, smollm2, or a model path")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            path = resolve_model(model, Path(tmp))
            vocab = 128 if model == "tiny" else 49_152
            for name, (trace, new_tokens) in scaled_workloads(vocab, small=model != "tiny").items():
                print(f"\n{model}: {name}, {new_tokens} output tokens each")
                print(f"{'policy':<14} {'prefill tokens':>15} {'hit rate':>9} {'req/s':>8} {'out tok/s':>10}")
                for policy in args.policies.split(","):
                    print(run_workload(path, policy, trace, new_tokens), flush=True)
    print("\nOne LPM scheduling round (match every waiting request + in-batch dedup):")
    for n in (128, 1000, 5000):
        print(f"  {n:>5} waiting requests: {lpm_round_seconds(n) * 1000:8.1f} ms")


def resolve_model(model: str, tmp: Path) -> str:
    if model == "tiny":
        return str(build_engine_folder(tmp / "tiny", max_position_embeddings=8192))
    if model == "smollm2":
        from radixserve.model.gguf_loader import default_model_path

        return default_model_path()
    return model


if __name__ == "__main__":
    main()
