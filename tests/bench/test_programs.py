"""``bench programs --tiny``: SGLang programs run against two servers, and the cache's effect shows in the counters."""

from __future__ import annotations

from radixserve.bench import programs


def test_programs_bench_runs_and_the_cache_saves_prompt_tokens() -> None:
    results = programs.main(["--tiny", "--count", "3", "--num-threads", "2", "--workloads", "mmlu,tree"])
    for name in ("mmlu", "tree"):
        on, off = results[name]["radix"], results[name]["none"]
        assert on["valid"] == off["valid"] == "3/3", results
        assert off["hit_rate"] == 0 and on["hit_rate"] > 0.5
        assert on["prefill_tokens"] < off["prefill_tokens"] / 2
