"""Prompt logprobs (SGLang's ``logprob_start_len``) on the offline engine, against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine

PROMPT = [5, 9, 17, 33, 4, 4, 60, 61, 62, 90, 91, 7, 8]


def hf_logprobs(folder: Path, ids: list[int]) -> list[float]:
    """log P(ids[p] | ids[:p]) for p = 1..len - 1."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    return [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]


@pytest.mark.parametrize("chunk", [4, 8192])
def test_prompt_logprobs_match_hf_across_chunks_and_cache_hits(tiny_model_dir: Path, chunk: int) -> None:
    engine = Engine.create(
        model_path=str(tiny_model_dir), max_total_tokens=1024, dtype="float32", chunked_prefill_size=chunk
    )
    expected = hf_logprobs(tiny_model_dir, PROMPT)
    for start in (0, 5, 11, 5):  # the second start=5 finds the whole prompt cached, and must not use it
        req = engine.make_request(PROMPT, {"max_new_tokens": 0}, logprob_start_len=start)
        engine.scheduler.add(req)
        while req.finish_reason is None:
            engine.step()
        result = req.result()
        assert result.output_ids == [] and result.finish_reason == "length"
        assert result.input_logprobs is not None and result.input_logprobs[0] is None
        assert result.input_logprobs[1:] == pytest.approx(expected[start:], abs=1e-4)
    assert result.cached_tokens == 5
    out = engine.make_request(PROMPT, {"max_new_tokens": 3, "temperature": 0}, logprob_start_len=12)
    engine.scheduler.add(out)
    while out.finish_reason is None:
        engine.step()
    assert out.result().input_logprobs == [None] and len(out.output_ids) == 3
    engine.check_idle_invariants()
