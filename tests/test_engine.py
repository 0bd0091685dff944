"""The offline engine end to end on a tiny random Llama saved as an HF folder."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.core import GenerateResult
from radixserve.engine import EngineConfig
from radixserve.engine.driver import Delta
from radixserve.model import paged_kernel
from radixserve.model.shared_prefix import SharedPrefixes, find_shared_prefixes
from tests.model.tiny import VOCAB

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def make_engine(tiny_model_dir: Path, **options: Any) -> Engine:
    # Exact token equality across cache hits and batch shapes: float32 (where --dtype auto means bf16,
    # a different split of the same tokens rounds differently).
    options.setdefault("dtype", "float32")
    return Engine.create(
        model_path=str(tiny_model_dir), max_total_tokens=options.pop("max_total_tokens", 2048), **options
    )


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


SHARED = list(range(3, 43))  # a 40-token shared preamble
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], SHARED[:20] + [70] * 9, [5, 6, 7]]


def test_generate_result_shape_and_slots_conserved(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    out = engine.generate(words([3, 4, 5]), GREEDY)
    assert isinstance(out, GenerateResult) and len(out.output_ids) == 12
    assert out.prompt_tokens == 3 and out.to_dict()["meta_info"]["completion_tokens"] == 12
    assert out.finish_reason == "length" and out.e2e_latency > 0 and out.cached_tokens == 0
    # specials are skipped; the text reads on from the prompt (prompt + text is the whole text)
    assert out.text == " " + words([i for i in out.output_ids if i > 2])
    engine.check_idle_invariants()


def test_greedy_output_equals_transformers_generate(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = [1, 9, 17, 33, 4, 88]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = make_engine(tiny_model_dir).generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20})
    assert out.output_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("prefix_cache,page_size", [("radix", 1), ("radix", 16), ("block", 16)])
def test_shared_prefix_hits_and_gives_the_same_tokens_as_no_cache(
    tiny_model_dir: Path, prefix_cache: str, page_size: int
) -> None:
    control = make_engine(tiny_model_dir, prefix_cache="none")
    cached = make_engine(tiny_model_dir, prefix_cache=prefix_cache, page_size=page_size)
    for prompt in PROMPTS[:2]:
        cold = control.generate(input_ids=prompt, sampling_params=GREEDY)
        warm = cached.generate(input_ids=prompt, sampling_params=GREEDY)
        assert warm.output_ids == cold.output_ids
        assert cold.cached_tokens == 0
    assert warm.cached_tokens == (40 if page_size == 1 else 32)
    cached.check_idle_invariants()
    control.check_idle_invariants()


def test_a_mixed_batch_equals_one_by_one(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    alone = [make_engine(tiny_model_dir).generate(input_ids=p, sampling_params=GREEDY).output_ids for p in PROMPTS]
    together = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r.output_ids for r in together] == alone
    engine.check_idle_invariants()


@pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the paged kernel cannot build")
def test_many_requests_on_one_shared_prefix_equal_one_by_one(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their decode steps read the cached preamble once for all of them (cascade attention)."""
    groups: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> SharedPrefixes:
        found = find_shared_prefixes(*args, **kwargs)
        groups.extend(np.diff(found.starts).tolist())
        return found

    monkeypatch.setattr(paged_kernel, "find_shared_prefixes", spy)
    preamble = [3 + i % 90 for i in range(100)]
    prompts = [preamble + [100 + i, 20 + i] for i in range(8)]
    engine = make_engine(tiny_model_dir, split_invariant=False)  # split invariance reads each prefix on its own
    engine.generate(input_ids=preamble, sampling_params={**GREEDY, "max_new_tokens": 1})
    together = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    alone = [make_engine(tiny_model_dir).generate(input_ids=p, sampling_params=GREEDY).output_ids for p in prompts]
    assert [r.output_ids for r in together] == alone
    assert max(groups) == 8  # all eight decoded as one group
    engine.check_idle_invariants()


@pytest.mark.parametrize("policy", ["lru", "adaptive", "learned"])
def test_a_tiny_pool_retracts_and_still_gives_the_same_tokens(tiny_model_dir: Path, policy: str) -> None:
    roomy = make_engine(tiny_model_dir)
    tight = make_engine(tiny_model_dir, max_total_tokens=160, radix_eviction_policy=policy)
    params = {**GREEDY, "max_new_tokens": 30}
    expected = [r.output_ids for r in roomy.generate(input_ids=PROMPTS, sampling_params=params)]
    got = tight.generate(input_ids=PROMPTS, sampling_params=params)
    assert [r.output_ids for r in got] == expected
    assert tight.scheduler.stats.retractions > 0
    tight.check_idle_invariants()


def test_stop_conditions(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    free = engine.generate(input_ids=[3, 4, 5], sampling_params=GREEDY).output_ids
    by_id = engine.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "stop_token_ids": [free[3]]})
    assert by_id.output_ids == free[: free.index(free[3]) + 1]
    assert by_id.finish_reason == "stop" and by_id.matched_stop == free[3]
    stop_word = f"w{free[2]}"
    by_text = engine.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "stop": [stop_word]})
    assert stop_word not in by_text.text and by_text.matched_stop == stop_word
    none = engine.generate(input_ids=[7, 8, 9, 10], sampling_params={**GREEDY, "max_new_tokens": 0})
    assert none.output_ids == [] and none.finish_reason == "length" and none.text == ""
    # It still prefilled its prompt into the cache (SGLang's frontend caches a prefix this way).
    after = engine.generate(input_ids=[7, 8, 9, 10, 11], sampling_params={**GREEDY, "max_new_tokens": 1})
    assert after.cached_tokens == 4
    engine.check_idle_invariants()


def test_seeded_sampling_is_reproducible_inside_any_batch(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    params = {"max_new_tokens": 10, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(input_ids=[3, 4, 5], sampling_params=params).output_ids
    batch = engine.generate(input_ids=[[9, 9], [3, 4, 5]], sampling_params=[{"max_new_tokens": 10}, params])
    assert batch[1].output_ids == alone


def test_seeds_that_differ_above_32_bits_draw_differently(tiny_model_dir: Path) -> None:
    """torch's CPU generator keeps a seed's low 32 bits: seeds 0 and 2^32 (and 5 and 2^32 + 5) gave the same
    samples. Each is its own stream now, and seeds below 2^32 still draw what they drew."""
    engine = make_engine(tiny_model_dir)
    params = {"max_new_tokens": 16, "temperature": 1.5, "ignore_eos": True}
    draws = {
        seed: engine.generate(input_ids=[3, 4, 5], sampling_params={**params, "seed": seed}).output_ids
        for seed in (0, 2**32, 5, 2**32 + 5, 2**63 - 1)
    }
    assert len({tuple(ids) for ids in draws.values()}) == len(draws)
    assert draws[5] == engine.generate(input_ids=[3, 4, 5], sampling_params={**params, "seed": 5}).output_ids


def test_chat_applies_the_template(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    via_chat = engine.chat([{"role": "user", "content": "w10 w11"}], GREEDY)
    direct = engine.generate(input_ids=[4, 10, 11, 99], sampling_params=GREEDY)
    assert via_chat.output_ids == direct.output_ids and via_chat.prompt_tokens == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_ids": []},
        {"input_ids": [3, VOCAB]},
        {"input_ids": [-1, 3]},
        {"input_ids": [3], "sampling_params": {"max_tokens": 3}},
        {"input_ids": [3], "sampling_params": {"temperature": -1}},
        {"input_ids": [[3], [4]], "sampling_params": [GREEDY]},
        {"input_ids": list(range(3, 100)) * 3},  # longer than the model's 256 positions
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(tiny_model_dir: Path, kwargs: dict[str, Any]) -> None:
    engine = make_engine(tiny_model_dir)
    engine.generate(input_ids=SHARED, sampling_params=GREEDY)
    before = (engine.allocator.free_size(), engine.cache.total_size())
    with pytest.raises(ValueError):
        engine.generate(**kwargs)
    assert (engine.allocator.free_size(), engine.cache.total_size()) == before
    engine.check_idle_invariants()
    assert engine.generate(input_ids=SHARED, sampling_params=GREEDY).cached_tokens == 39


def test_unknown_engine_option_is_an_error(tiny_model_dir: Path) -> None:
    with pytest.raises(TypeError):
        Engine.create(model_path=str(tiny_model_dir), max_total_tokenz=100)
    with pytest.raises(ValueError, match="prefix_cache"):
        Engine.create(model_path=str(tiny_model_dir), prefix_cache="lru")


def test_engine_takes_the_options_sglang_and_vllm_users_type(tiny_model_dir: Path) -> None:
    """``Engine(model_path=...)`` as ``sgl.Engine(...)`` / ``LLM(...)`` users write it; ``Engine.create`` stays."""
    options: dict[str, Any] = {"model_path": str(tiny_model_dir), "max_total_tokens": 256, "dtype": "float32"}
    engine = Engine(**options, disable_radix_cache=True)
    assert engine.config == EngineConfig(**options, prefix_cache="none")
    assert (
        engine.generate(words([3, 4, 5]), GREEDY).output_ids
        == make_engine(tiny_model_dir).generate(words([3, 4, 5]), GREEDY).output_ids
    )
    with pytest.raises(TypeError, match="max_total_tokenz"):
        Engine(model_path=str(tiny_model_dir), max_total_tokenz=100)
    with pytest.raises(TypeError, match="not both"):
        Engine(EngineConfig(**options), page_size=2)
    with pytest.raises(TypeError, match="model_path="):
        Engine(str(tiny_model_dir))  # type: ignore[arg-type]


def test_one_thread_turns_the_loop_and_the_others_go_through_its_inbox(tiny_model_dir: Path) -> None:
    """While a server's thread runs the loop, another thread submits to it and calls into it, never around it."""
    engine = make_engine(tiny_model_dir)
    offline = engine.generate(input_ids=SHARED, sampling_params=GREEDY)
    stopping = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stopping,))
    loop.start()
    try:
        deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        engine.submit(engine.make_request(SHARED, GREEDY), deltas.put)
        received = [deltas.get(timeout=60)]
        while received[-1].result is None:
            received.append(deltas.get(timeout=60))
        assert [t for d in received for t in d.token_ids] == offline.output_ids
        assert received[-1].result is not None and received[-1].result.cached_tokens == len(SHARED) - 1
        with pytest.raises(RuntimeError, match="another thread"):
            engine.generate(input_ids=SHARED, sampling_params=GREEDY)
        with pytest.raises(RuntimeError, match="engine.call"):
            engine.flush_cache()
        assert engine.call(engine.snapshot).result(60)["num_running"] == 0
        assert engine.call(engine.flush_cache).result(60) > 0
    finally:
        stopping.set()
        engine.call(lambda: None)
        loop.join(60)
    assert engine.failure is None and engine.generate(input_ids=SHARED, sampling_params=GREEDY).cached_tokens == 0
    engine.check_idle_invariants()


def test_a_dying_loop_fails_every_request_loudly(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the loop itself: every submitted request ends with the error, and nothing waits on it forever."""
    engine = make_engine(tiny_model_dir)

    def broken() -> None:
        raise RuntimeError("injected loop failure")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
    for index, prompt in enumerate(PROMPTS):
        engine.submit(engine.make_request(prompt, GREEDY), deltas.put, index)
    loop = threading.Thread(target=engine.run_forever, args=(threading.Event(),))
    loop.start()
    loop.join(60)
    results = [deltas.get(timeout=5).result for _ in PROMPTS]
    assert all(
        r is not None and r.finish_reason == "abort" and "injected loop failure" in (r.error or "") for r in results
    )
    assert isinstance(engine.failure, RuntimeError)
    with pytest.raises(RuntimeError, match="stopped"):
        engine.call(lambda: None).result(5)
