"""Embedding requests on the engine (``return_hidden``): the last prompt token's final hidden state, as
transformers computes it, whatever the batch, the chunking or the cache hit around it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine
from radixserve.scheduler.request import Request

PROMPT = [5, 9, 17, 33, 4, 4, 60, 61, 62, 90, 91, 7, 8]


def hf_last_hidden(folder: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()  # after the final norm


def embedding_request(engine: Engine, ids: list[int]) -> Request:
    req = engine.make_request(ids, {"max_new_tokens": 0, "temperature": 0.0})
    req.return_hidden = True
    return req


def run(engine: Engine, *requests: Request) -> None:
    for req in requests:
        engine.scheduler.add(req)
    while any(req.finish_reason is None for req in requests):
        engine.step()


@pytest.mark.parametrize("chunk", [4, 8192])
def test_hidden_state_matches_hf_alone_batched_and_from_the_cache(tiny_model_dir: Path, chunk: int) -> None:
    engine = Engine.create(
        model_path=str(tiny_model_dir), max_total_tokens=1024, dtype="float32", chunked_prefill_size=chunk
    )
    expected = hf_last_hidden(tiny_model_dir, PROMPT)
    alone = embedding_request(engine, PROMPT)
    run(engine, alone)
    result = alone.result()
    assert result.output_ids == [] and result.finish_reason == "length" and result.cached_tokens == 0
    assert result.hidden_state is not None and np.allclose(result.hidden_state, expected, atol=1e-4)
    # Beside a generating request and a prompt-logprobs one (every row's logits), the prefix now cached.
    again = embedding_request(engine, PROMPT)
    other = embedding_request(engine, PROMPT[:6] + [70, 71])
    talker = engine.make_request([40, 41, 42], {"max_new_tokens": 4, "temperature": 0.0})
    scorer = engine.make_request([50, 51, 52, 53], {"max_new_tokens": 0}, logprob_start_len=0)
    run(engine, again, other, talker, scorer)
    assert again.cached_tokens == len(PROMPT) - 1  # only the last token ran
    assert np.allclose(again.result().hidden_state or [], expected, atol=1e-4)
    assert np.allclose(
        other.result().hidden_state or [], hf_last_hidden(tiny_model_dir, PROMPT[:6] + [70, 71]), atol=1e-4
    )
    assert talker.result().hidden_state is None and len(talker.output_ids) == 4
    assert scorer.result().input_logprobs is not None and scorer.result().hidden_state is None
    engine.check_idle_invariants()
