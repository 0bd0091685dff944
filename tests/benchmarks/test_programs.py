"""``bench programs --tiny``: SGLang programs run against two servers, and the cache's effect shows in the counters."""

from __future__ import annotations

import json
from typing import Any

from benchmarks import programs


def test_programs_bench_runs_and_the_cache_saves_prompt_tokens() -> None:
    workloads = ("mmlu", "tree", "json")
    results = programs.main(["--tiny", "--count", "3", "--num-threads", "2", "--workloads", ",".join(workloads)])
    for name in workloads:
        on, off = results[name]["radix"], results[name]["none"]
        # json: the tiny model spends a byte per token, so it gets the room to close its object
        assert on["valid"] == off["valid"] == "3/3", results
        assert off["hit_rate"] == 0 and on["hit_rate"] > 0.5
        assert on["prefill_tokens"] < off["prefill_tokens"] / 2


class FakeState:
    def __init__(self, text: str, finish_reason: Any) -> None:
        self.text, self.finish_reason = text, finish_reason

    def error(self) -> None:
        return None

    def __getitem__(self, name: str) -> str:
        return self.text

    def get_meta_info(self, name: str) -> dict[str, Any]:
        return {"finish_reason": self.finish_reason}


def test_json_outputs_cut_by_max_tokens_are_counted_apart_from_invalid_ones() -> None:
    whole = json.dumps({"name": "Ada", "island": "Avel", "age": 30, "ferry_pass": True})
    states = [
        FakeState(whole, "stop"),
        FakeState('{"name": "Ad', "length"),  # our server's shape
        FakeState('{"name": "Ad', {"type": "length", "length": 64}),  # SGLang's
    ]
    assert programs.validity("json", states) == "1/3 (2 cut by max_tokens)"
    assert programs.validity("json", states[:1]) == "1/1"
