"""The scheduler on a tiny model: count tokens, never time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixserve import Engine
from radixserve.core import SamplingParams
from radixserve.scheduler.batch import StepOutput
from radixserve.scheduler.request import Request, Status
from radixserve.scheduler.stats import RECENT_REQUESTS, RequestTiming, SchedulerStats
from tests.model.tiny import build_engine_folder

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_folder(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)


def make_engine(model_dir: Path, **options: Any) -> Engine:
    # Exact token equality across cache hits and batch shapes: float32 (where --dtype auto means bf16,
    # a different split of the same tokens rounds differently).
    options.setdefault("dtype", "float32")
    return Engine.create(model_path=str(model_dir), max_total_tokens=options.pop("max_total_tokens", 8192), **options)


def burst(rng: np.random.Generator, shared_len: int = 2000, suffix_len: int = 50, n: int = 64) -> list[list[int]]:
    """Each suffix starts with its own token, so no two requests share more than the prefix."""
    shared = rng.integers(3, 128, shared_len).tolist()
    return [shared + [3 + i] + rng.integers(3, 128, suffix_len - 1).tolist() for i in range(n)]


def test_burst_on_a_cold_prefix_prefills_it_once_with_dedup(model_dir: Path) -> None:
    prompts = burst(np.random.default_rng(0))
    # One step could admit all 64 at once: only in-batch dedup stops them all computing the prefix.
    options = dict(max_total_tokens=140_000, chunked_prefill_size=200_000, max_running_requests=64)
    deduped = make_engine(model_dir, schedule_policy="lpm", in_batch_dedup=True, **options)
    control = make_engine(model_dir, schedule_policy="fcfs", in_batch_dedup=False, **options)
    with_dedup = deduped.generate(input_ids=prompts, sampling_params=GREEDY)
    without = control.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r.output_ids for r in with_dedup] == [r.output_ids for r in without]
    # The first request computes the 2,000 shared tokens; every request computes its own 50.
    assert deduped.scheduler.stats.prefill_tokens == 2000 + 64 * 50
    assert control.scheduler.stats.prefill_tokens == 64 * 2050
    assert sum(r.cached_tokens for r in with_dedup) == 63 * 2000
    deduped.check_idle_invariants()
    control.check_idle_invariants()


def test_memory_pressure_retracts_resumes_and_recomputes_only_what_was_evicted(model_dir: Path) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, n).tolist() for n in (300, 280, 260, 240, 220, 200)]
    params = {**GREEDY, "max_new_tokens": 80}
    roomy = make_engine(model_dir)
    tight = make_engine(model_dir, max_total_tokens=1024)
    expected = [r.output_ids for r in roomy.generate(input_ids=prompts, sampling_params=params)]
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert [r.output_ids for r in got] == expected
    stats = tight.scheduler.stats
    assert stats.retractions > 0
    # Everything prefilled is the prompts once, plus exactly what resumptions recomputed, plus
    # the newest token of each request retracted mid-decode (it had no K/V yet).
    assert stats.prefill_tokens == sum(map(len, prompts)) + stats.recomputed_tokens + stats.decode_retractions
    tight.check_idle_invariants()
    snapshot = tight.scheduler.snapshot()
    assert snapshot["retractions"] == stats.retractions and snapshot["evicted_tokens"] == tight.cache.evicted_tokens > 0
    assert snapshot["num_running"] == snapshot["num_waiting"] == 0 and snapshot["token_usage"] == 0.0
    assert snapshot["finished"] == {"length": len(prompts)}
    # A resumed request counts its prompt once (the hit rate's denominator) and keeps its first admission.
    assert stats.prompt_tokens == sum(map(len, prompts)) and stats.generated_tokens == len(prompts) * 80
    timings = list(stats.recent)
    assert sorted(t.prompt_tokens for t in timings) == sorted(map(len, prompts))
    for t in timings:  # queue, prefill, decode: one after the other
        assert t.admitted is not None and t.first_token is not None
        assert t.arrival <= t.admitted <= t.first_token <= t.finish and t.output_tokens == 80


def test_the_timing_ring_keeps_only_the_last_requests() -> None:
    stats = SchedulerStats()
    for rid in range(RECENT_REQUESTS + 5):
        stats.count_finish(RequestTiming(rid, None, 0.0, 1.0, 2.0, 3.0, 10, 0, 1, "length"))
    assert [t.rid for t in stats.recent] == list(range(5, RECENT_REQUESTS + 5))
    assert stats.finished == {"length": RECENT_REQUESTS + 5}


def test_chunked_prefill_gives_the_same_tokens(model_dir: Path) -> None:
    prompts = [list(range(3, 120)) * 3, list(range(5, 100))]
    whole = make_engine(model_dir).generate(input_ids=prompts, sampling_params=GREEDY)
    engine = make_engine(model_dir, chunked_prefill_size=32)
    chunked = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]
    engine.check_idle_invariants()


def new_request(rid: int, prompt: list[int], **params: Any) -> Request:
    return Request(rid, np.asarray(prompt, dtype=np.int64), SamplingParams(**{**GREEDY, **params}))


def test_a_second_request_hits_the_first_while_it_is_still_prefilling(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=64)
    sched = engine.scheduler
    long_prompt = list(range(3, 123)) * 2  # 240 tokens: four chunks
    first = new_request(1, long_prompt)
    sched.add(first)
    engine.step()
    engine.step()  # two chunks in: 128 tokens cached and locked by the running request
    assert first.status is Status.RUNNING and not first.prefill_done
    second = new_request(2, long_prompt[:100] + [7, 7, 7])
    sched.add(second)
    while second.status is Status.WAITING:
        first_still_prefilling = not first.prefill_done
        engine.step()  # the step that admits the second request matches against the cache first
    assert second.cached_tokens >= 99 and first_still_prefilling
    while sched.has_work():
        engine.step()
    engine.check_idle_invariants()


def test_max_new_tokens_zero_prefills_in_chunks_into_the_cache_then_finishes(model_dir: Path) -> None:
    """SGLang's frontend caches a prefix with max_new_tokens 0: it must run like any prompt, not end on arrival."""
    engine = make_engine(model_dir, chunked_prefill_size=64)
    sched = engine.scheduler
    prompt = list(range(3, 123)) * 2  # 240 tokens: four chunks
    warm = new_request(1, prompt, max_new_tokens=0)
    sched.add(warm)
    steps = 0
    while sched.has_work():
        engine.step()
        steps += 1
    assert steps == 4 and sched.stats.prefill_tokens == 240
    assert warm.finish_reason == "length" and warm.output_ids == [] and warm.text == "" and warm.kv is None
    engine.check_idle_invariants()  # nothing locked, every slot free or cached
    assert engine.cache.total_size() == 240
    hit = new_request(2, prompt + [7], max_new_tokens=2)
    sched.add(hit)
    while sched.has_work():
        engine.step()
    assert hit.cached_tokens == 240 and sched.stats.prefill_tokens == 241
    # Aborted mid-prefill: its slots are freed, not cached (the chunks done so far stay shared).
    gone = new_request(3, list(range(5, 125)) * 2, max_new_tokens=0)
    sched.add(gone)
    engine.step()
    assert gone.status is Status.RUNNING and sched.abort(gone) and gone.finish_reason == "abort"
    engine.check_idle_invariants()


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "mid-decode"])
def test_abort_in_any_state_frees_everything(model_dir: Path, when: str) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=64)
    sched = engine.scheduler
    victim, bystander = new_request(1, list(range(3, 123)) * 2, max_new_tokens=20), new_request(2, [9, 8, 7])
    sched.add(bystander)
    sched.add(victim)
    steps = {"waiting": 0, "mid-prefill": 2, "mid-decode": 8}[when]
    for _ in range(steps):
        engine.step()
    state = {"waiting": Status.WAITING, "mid-prefill": Status.RUNNING, "mid-decode": Status.RUNNING}[when]
    assert victim.status is state and victim.prefill_done == (when == "mid-decode")
    assert sched.abort(victim) and not sched.abort(victim)
    assert victim.finish_reason == "abort" and victim.kv is None and victim.status is Status.ABORTED
    engine.cache.check_invariants()
    while sched.has_work():
        engine.step()
    assert bystander.finish_reason == "length"
    engine.check_idle_invariants()


def test_a_prompt_that_fills_the_pool_is_prefilled_in_chunks_and_finishes(model_dir: Path) -> None:
    engine = make_engine(model_dir, max_total_tokens=256, chunked_prefill_size=64)
    out = engine.generate(input_ids=list(range(3, 123)) * 2, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert out.finish_reason == "length" and len(out.output_ids) == 10
    engine.check_idle_invariants()


def test_requests_that_cannot_fit_next_to_each_other_end_with_a_clear_error_not_a_hang(model_dir: Path) -> None:
    engine = make_engine(model_dir, max_total_tokens=256, chunked_prefill_size=64)
    prompts = [list(range(3, 123)) * 2, list(range(120, 2, -1)) * 2]  # 240 tokens each, nothing shared
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
    reasons = sorted(str(r.finish_reason) for r in outs)
    assert reasons in (["abort", "length"], ["length", "length"])
    assert all(r.error for r in outs if r.finish_reason == "abort")
    engine.check_idle_invariants()


def test_schedule_says_what_runs_the_step_reports_and_process_applies(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=64)
    sched = engine.scheduler
    req = new_request(1, list(range(3, 123)), max_new_tokens=2)  # 120 tokens: a 64-token chunk, then 56
    sched.add(req)
    batch = sched.schedule()
    assert [(e.req, e.mode, len(e.new_token_ids), e.sample) for e in batch.entries] == [(req, "extend", 64, False)]
    outputs = engine.executor.run(batch)
    assert outputs == [StepOutput()] and not req.prefill_done  # a chunk: computed, no token
    assert sched.process(batch, outputs) == []
    batch = sched.schedule()
    assert [(e.mode, len(e.new_token_ids), e.sample) for e in batch.entries] == [("extend", 56, True)]
    outputs = engine.executor.run(batch)
    token = outputs[0].token
    assert token is not None and req.output_ids == []  # the step changes no request
    sched.process(batch, outputs)
    assert req.output_ids == [token] and req.prefill_done
    batch = sched.schedule()
    assert batch.mode == "decode" and len(batch.entries[0].new_token_ids) == 1
    assert sched.process(batch, engine.executor.run(batch)) == [req] and req.finish_reason == "length"
    assert sched.stats.prefill_tokens == 120
    engine.check_idle_invariants()


def test_a_failed_step_output_aborts_only_its_request(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    sched = engine.scheduler
    broken, fine = new_request(1, [5, 6, 7]), new_request(2, [8, 9, 10])
    sched.add(broken)
    sched.add(fine)
    batch = sched.schedule()
    outputs = engine.executor.run(batch)
    outputs[0] = StepOutput(computed=False, error="injected")
    assert sched.process(batch, outputs) == [broken]
    assert broken.error == "injected" and broken.status is Status.ABORTED and fine.status is Status.RUNNING
    assert sched.stats.prefill_tokens == 3  # only what the forward computed
    while sched.has_work():
        engine.step()
    engine.check_idle_invariants()


def test_abort_covers_a_request_not_yet_queued(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    req = new_request(1, [5, 6, 7])
    assert engine.scheduler.abort(req, "the client went away")
    assert req.status is Status.ABORTED and req.finish_reason == "abort" and req.error == "the client went away"
    assert req.finish_time is not None and req.result().error == "the client went away"
    assert not engine.scheduler.abort(req, "twice") and req.error == "the client went away"
    assert engine.scheduler.stats.finished["abort"] == 1
    engine.check_idle_invariants()
