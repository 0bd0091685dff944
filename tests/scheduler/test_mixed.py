"""Mixed batches (``enable_mixed_chunk``): a prefill chunk and every running decode in one step.

Counted in steps and tokens, never time: with the flag on, a long chunked
prompt never takes a step from the decoders, and the tokens are the same as
with it off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixserve import Engine
from radixserve.scheduler.batch import ScheduledBatch, StepOutput
from tests.model.tiny import build_engine_folder
from tests.scheduler.test_loop import GREEDY, make_engine, new_request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_folder(tmp_path_factory.mktemp("tiny-mixed"), max_position_embeddings=4096)


def decoders_then_long_prompt(engine: Engine) -> list[tuple[int, int]]:
    """Three requests decode, then a 400-token prompt arrives (64-token chunks): per step until
    it has its first token, (its new tokens in the batch, how many decodes ran next to it)."""
    sched = engine.scheduler
    decoders = [new_request(i, list(range(3 + i, 40 + i)), max_new_tokens=40) for i in range(3)]
    for req in decoders:
        sched.add(req)
    while not all(r.prefill_done for r in decoders):
        engine.step()
    long = new_request(9, list(range(127, 27, -1)) * 4, max_new_tokens=4)  # shares nothing with them
    sched.add(long)
    steps = []
    while not long.prefill_done:
        batch = sched.schedule()
        chunk = sum(len(e.new_token_ids) for e in batch.entries if e.req is long)
        steps.append((chunk, sum(e.mode == "decode" and e.req in decoders for e in batch.entries)))
        sched.process(batch, engine.executor.run(batch))
    while sched.has_work():
        engine.step()
    return steps


def test_with_mixed_chunks_every_prefill_chunk_runs_next_to_every_decode(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=64, enable_mixed_chunk=True)
    steps = decoders_then_long_prompt(engine)
    assert steps == [(64, 3)] * 6 + [(16, 3)]  # 400 tokens in 7 chunks, each beside all 3 decoders
    engine.check_idle_invariants()
    # Without the flag, decode and prefill steps alternate: every chunk costs the decoders a step.
    control = make_engine(model_dir, chunked_prefill_size=64)
    assert decoders_then_long_prompt(control) == [(0, 3), (64, 0)] * 6 + [(0, 3), (16, 0)]


def test_a_mixed_batch_reports_its_mode_and_the_step_samples_only_finished_prompts(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=32, enable_mixed_chunk=True)
    sched = engine.scheduler
    first = new_request(1, list(range(3, 13)), max_new_tokens=3)
    sched.add(first)
    engine.step()
    second = new_request(2, list(range(3, 83)))  # 80 tokens: chunks of 32, 32, 16
    sched.add(second)
    batch = sched.schedule()
    assert batch.mode == "mixed"
    assert [(e.req, e.mode, len(e.new_token_ids), e.sample) for e in batch.entries] == [
        (second, "extend", 32, False),
        (first, "decode", 1, True),
    ]
    outputs = engine.executor.run(batch)
    assert outputs[0] == StepOutput() and outputs[1].token is not None
    sched.process(batch, outputs)
    assert len(first.output_ids) == 2 and not second.prefill_done
    while sched.has_work():
        engine.step()
    assert len(second.output_ids) == GREEDY["max_new_tokens"]
    engine.check_idle_invariants()


def record_modes(engine: Engine) -> list[str]:
    """The mode of every non-empty batch the engine's step runs from now on."""
    modes: list[str] = []
    run = engine.executor.run

    def recording(batch: ScheduledBatch) -> list[StepOutput]:
        if batch:
            modes.append(batch.mode)
        return run(batch)

    engine.executor.run = recording  # type: ignore[method-assign]
    return modes


@pytest.mark.parametrize("max_total_tokens", [8192, 1024])
def test_mixed_chunks_give_the_same_tokens(model_dir: Path, max_total_tokens: int) -> None:
    """Staggered lengths under small chunks make most steps mixed; 1,024 slots also force retractions."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 128, n).tolist() for n in (300, 40, 260, 90, 220, 200)]
    params = {**GREEDY, "max_new_tokens": 80}  # past the 64-token decode reserve: decode can run short
    options = dict(chunked_prefill_size=48, max_total_tokens=max_total_tokens)
    plain = make_engine(model_dir, **options)
    mixed = make_engine(model_dir, enable_mixed_chunk=True, **options)
    modes = record_modes(mixed)
    expected = [r.output_ids for r in plain.generate(input_ids=prompts, sampling_params=params)]
    assert [r.output_ids for r in mixed.generate(input_ids=prompts, sampling_params=params)] == expected
    assert modes.count("mixed") >= 10
    if max_total_tokens == 1024:
        assert mixed.scheduler.stats.retractions > 0
    mixed.check_idle_invariants()
    plain.check_idle_invariants()


def test_a_mixed_forward_that_fails_for_its_chunk_fails_only_that_request(model_dir: Path) -> None:
    """The step retries each entry alone in its own mode: the decoder goes on, the chunk's request aborts."""
    poison = 77
    decoder = list(range(3, 23))
    clean = make_engine(model_dir).generate(input_ids=decoder, sampling_params=GREEDY).output_ids
    engine = make_engine(model_dir, chunked_prefill_size=32, enable_mixed_chunk=True)
    forward = engine.executor.runner.forward
    modes: list[str] = []

    def failing(inputs: Any, mode: str) -> Any:
        modes.append(mode)
        if any(poison in np.asarray(step.new_token_ids).tolist() for step in inputs):
            raise RuntimeError("injected kernel failure")
        return forward(inputs, mode)

    sched = engine.scheduler
    first = new_request(1, decoder)
    sched.add(first)
    engine.step()
    engine.executor.runner.forward = failing  # type: ignore[method-assign]
    broken = new_request(2, [poison] * 40)
    sched.add(broken)
    while sched.has_work():
        engine.step()
    assert modes[:3] == ["mixed", "extend", "decode"]
    assert broken.finish_reason == "abort" and broken.error is not None and "injected" in broken.error
    assert first.finish_reason == "length" and first.output_ids == clean
    engine.check_idle_invariants()
