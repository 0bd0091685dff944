"""Fault containment: one request that breaks a step fails alone; the rest finish with correct output.

Each fault is injected around the real engine (monkeypatched model call, sampler
or detokenizer) for exactly one request of a mixed batch. Afterwards: that
request aborted with a clear error, every other request's tokens equal a clean
run's, and the engine is idle with no lock held and no slot leaked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import radixserve.engine.step as step_module
from radixserve import Engine
from radixserve.cache import RadixKey

PARAMS = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
POISON = 77  # the token that marks the faulty request's prompt
PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 9, 10], [5, 6, POISON, 11], [20, 21, 22]]


@pytest.fixture(scope="module")
def clean(tiny_model_dir: Path) -> list[list[int]]:
    engine = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=2048)
    return [out.output_ids for out in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def run_with(tiny_model_dir: Path, patch: Callable[[Engine], None], params: Any = PARAMS) -> tuple[Engine, list[Any]]:
    engine = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=2048)
    patch(engine)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert isinstance(outs, list)
    return engine, outs


def check_contained(engine: Engine, outs: list[Any], clean: list[list[int]], words: str) -> None:
    faulty = outs[2]
    assert faulty.finish_reason == "abort" and faulty.error is not None and words in faulty.error, faulty
    for i in (0, 1, 3):
        assert outs[i].finish_reason == "length" and outs[i].output_ids == clean[i]
    engine.check_idle_invariants()
    assert len(engine.cache.match_prefix(RadixKey([5, 6, POISON])).indices) == 2  # its own tokens never cached


def test_a_model_call_that_fails_for_one_request(tiny_model_dir: Path, clean: list[list[int]]) -> None:
    def patch(engine: Engine) -> None:
        forward = engine.executor.runner.forward

        def failing(inputs: Any, mode: str) -> torch.Tensor:
            for step in inputs:
                if POISON in np.asarray(step.new_token_ids).tolist():
                    raise RuntimeError("injected kernel failure")
            return forward(inputs, mode)

        engine.executor.runner.forward = failing  # type: ignore[method-assign]

    engine, outs = run_with(tiny_model_dir, patch)
    check_contained(engine, outs, clean, "injected kernel failure")


def test_nan_logits_for_one_request(tiny_model_dir: Path, clean: list[list[int]]) -> None:
    def patch(engine: Engine) -> None:
        forward = engine.executor.runner.forward

        def poisoned(inputs: Any, mode: str) -> torch.Tensor:
            logits = forward(inputs, mode).clone()  # an inference tensor: copy before writing
            for row, step in enumerate(inputs):
                if POISON in np.asarray(step.new_token_ids).tolist():
                    logits[row, 3] = float("nan")
            return logits

        engine.executor.runner.forward = poisoned  # type: ignore[method-assign]

    engine, outs = run_with(tiny_model_dir, patch)
    check_contained(engine, outs, clean, "non-finite logits")


def test_a_sampler_error_for_one_request(
    tiny_model_dir: Path, clean: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = step_module.sample

    def picky(logits: torch.Tensor, states: Any) -> Any:
        if any(POISON in s.prompt_ids for s in states):
            raise ValueError("injected sampler failure")
        return real(logits, states)

    monkeypatch.setattr(step_module, "sample", picky)
    engine, outs = run_with(tiny_model_dir, lambda engine: None)
    check_contained(engine, outs, clean, "injected sampler failure")


def test_a_detokenizer_error_for_one_request(tiny_model_dir: Path, clean: list[list[int]]) -> None:
    def patch(engine: Engine) -> None:
        make_decoder = engine.output.make_decoder

        def fragile(req: Any) -> Any:
            decoder = make_decoder(req)
            if POISON in req.prompt_ids.tolist():

                def push(new_ids: Any) -> str:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

                decoder.push = push
            return decoder

        engine.output.make_decoder = fragile  # type: ignore[method-assign]

    engine, outs = run_with(tiny_model_dir, patch, {**PARAMS, "stop": ["never-generated"]})
    check_contained(engine, outs, clean, "UnicodeDecodeError")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_rows_flags_exactly_the_rows_with_nan_or_inf(dtype: torch.dtype) -> None:
    logits = torch.randn(6, 300).to(dtype)
    logits[1, 7] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 299] = float("-inf")
    logits[4, :] = float("inf")  # every entry inf: max == min, still flagged
    logits[5, 1], logits[5, 2] = torch.finfo(dtype).max, torch.finfo(dtype).min  # huge but finite: fine
    assert step_module.finite_rows(logits) == [True, False, False, False, False, True]
    assert step_module.finite_rows(logits) == torch.isfinite(logits).all(dim=-1).tolist()
