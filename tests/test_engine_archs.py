"""Every architecture through the engine: a prefix-cache hit (radix page 1 and 16, block) gives the tokens a
cold run gives, on prompts longer than the sliding window; describe() says what was loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.model.summary import format_summary
from tests.model.test_archs import CASES

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SHARED = list(range(3, 43))  # 40 tokens: five 8-token windows
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], SHARED[:20] + [70] * 9]
ENGINE_CASES = ["qwen3", "mistral_window", "phi3_window", "gemma2", "gemma3"]


@pytest.fixture(scope="module")
def folders(arch_folder: Callable[..., Path]) -> dict[str, Path]:
    """The HF folders of tests/model/test_archs.py's cases (with their fixture tokenizers), built once."""
    return {case: arch_folder(CASES[case][0], **CASES[case][1]) for case in ENGINE_CASES}


def make_engine(folder: Path, **options: Any) -> Engine:
    return Engine.create(model_path=str(folder), dtype="float32", max_total_tokens=1024, **options)


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_cache_hits_give_the_tokens_of_a_cold_run(folders: dict[str, Path], case: str) -> None:
    control = make_engine(folders[case], prefix_cache="none")
    cold = [control.generate(input_ids=p, sampling_params=GREEDY).output_ids for p in PROMPTS]
    for prefix_cache, page_size in (("radix", 1), ("radix", 16), ("block", 16)):
        cached = make_engine(folders[case], prefix_cache=prefix_cache, page_size=page_size)
        results = [cached.generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS]
        assert [r.output_ids for r in results] == cold, (prefix_cache, page_size)
        assert results[1].cached_tokens == (40 if page_size == 1 else 32)
        cached.check_idle_invariants()


def test_describe_names_the_architecture_and_its_differences(folders: dict[str, Path]) -> None:
    info = make_engine(folders["gemma3"]).describe()
    assert info["architecture"] == "gemma3" and info["num_layers"] == 4
    assert (info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (4, 2, 16)
    assert info["sliding_window"] == 8 and info["layer_types"] == "3 sliding, 1 full"
    assert "theta 1e+06, linear" in info["rope"] and "sliding layers theta 10000" in info["rope"]
    assert info["tokenizer_kind"] and info["chat_template_source"]
    assert info["weight_bytes"] > 0 and info["context_length"] == 512
    text = format_summary(info)  # what `radixserve serve` logs at start
    assert "architecture gemma3, 4 layers, heads 4, kv heads 2, head dim 16, context 512" in text
    assert "sliding window 8 (3 sliding, 1 full)" in text and "chat template: gemma3/chat_template.jinja" in text
    assert "tokenizer HF tokenizer.json" in text and "MiB (float32, quantization none)" in text
