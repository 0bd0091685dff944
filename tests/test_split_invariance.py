"""A cache hit never changes an answer (issue 37, items 1-2): on the embedded SmolLM2 in the default configuration
(its own Q4_1 / Q8_0 blocks, the default dtype), a prompt whose first ``split`` tokens are cached, asked alone or
beside other prompts, gives the cold run's greedy tokens and the cold run's first-token logprobs bit for bit
(log-softmax of the last position's logits). Before the block linears ran one kernel at every row count, 11 of
40 greedy answers and 38 of 40 logprob rows changed with the split in bfloat16 (the vendor GEMM's bits depend
on the row count). ``bench split-invariance`` runs the same check over 1,000 pairs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.split_invariance import corpus_words
from radixserve import Engine
from radixserve.engine import config as engine_config
from radixserve.engine.config import EngineConfig
from radixserve.model.invariance import amx_available

GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "top_logprobs": 5}
CACHE_PREFIX = {"max_new_tokens": 1, "temperature": 0.0}
WORDS = corpus_words()


def prompt(engine: Engine, start: int, words: int) -> list[int]:
    return engine.tokenizer.encode(" ".join(WORDS[start : start + words]))


def answers(engine: Engine, ids: list[int], companions: list[list[int]]) -> tuple[list[int], list[object]]:
    out = engine.generate(input_ids=[ids, *companions], sampling_params=GREEDY)[0]
    return out.output_ids, out.output_top_logprobs


def check_split(engine: Engine, ids: list[int], split: int, companions: list[list[int]], tiers: bool = False) -> None:
    engine.flush_cache()
    cold = answers(engine, ids, [])
    engine.flush_cache()
    engine.generate(input_ids=ids[:split], sampling_params=CACHE_PREFIX)
    if tiers:  # the prefix comes back from host memory (L2), not the pool
        engine.flush_cache(tiers=("device",))
    hot = engine.generate(input_ids=[ids, *companions], sampling_params=GREEDY)[0]
    if tiers:  # the host tier holds whole tier pages: a short prefix may not be there
        assert hot.cached_tokens > 0 or split < 64
    else:
        assert hot.cached_tokens >= min(split, len(ids) - 1) // engine.config.page_size * engine.config.page_size
    assert (hot.output_ids, hot.output_top_logprobs) == cold, (split, len(ids), len(companions))
    engine.check_idle_invariants()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine(max_total_tokens=2048)
    assert engine.split_invariant, engine.split_invariant_reason
    yield engine
    engine.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    start=st.integers(0, len(WORDS) - 200),
    words=st.integers(20, 90),
    split=st.floats(0.0, 1.0),
    companions=st.lists(st.tuples(st.integers(0, len(WORDS) - 200), st.integers(3, 60)), max_size=3),
)
def test_a_cache_hit_changes_no_answer(
    engine: Engine, start: int, words: int, split: float, companions: list[tuple[int, int]]
) -> None:
    ids = prompt(engine, start, words)
    others = [prompt(engine, at, n) for at, n in companions]
    check_split(engine, ids, 1 + int(split * (len(ids) - 2)), others)


def test_companions_sharing_the_prefix_change_no_answer(engine: Engine) -> None:
    """Decode rows beside requests that share their cached prefix (a system prompt's case). The shared-prefix
    (cascade) pass reads that prefix once for them all and merges its partial softmax with each row's own: other
    bits than a row alone (up to 0.31 on a bfloat16 logit), so split invariance turns it off."""
    ids = prompt(engine, 500, 150)
    shared = ids[:100]  # over shared_prefix.MIN_SHARED_PREFIX_LEN
    companions = [shared + prompt(engine, at, 25) for at in (40, 900, 1300)]
    engine.flush_cache()
    alone = answers(engine, ids, [])
    engine.flush_cache()
    engine.generate(input_ids=shared, sampling_params=CACHE_PREFIX)
    outs = engine.generate(input_ids=[ids, *companions], sampling_params={**GREEDY, "max_new_tokens": 8})
    assert all(out.cached_tokens >= 100 for out in outs)
    assert (outs[0].output_ids[:3], outs[0].output_top_logprobs[:3]) == alone
    engine.check_idle_invariants()


@pytest.mark.parametrize(
    "options",
    [
        {"page_size": 16},
        {"hicache_size": 0.05, "hicache_write_policy": "write_through"},
        {"quantization": "q4_1"},
        {"dtype": "float32"},
    ],
    ids=["page-16", "host-tier", "int8-activations", "float32"],
)
def test_other_configurations_keep_it(options: dict[str, object]) -> None:
    engine = Engine(max_total_tokens=2048, **options)
    assert engine.split_invariant, engine.split_invariant_reason
    ids = prompt(engine, 1234, 80)
    for split in (1, 17, len(ids) // 2, len(ids) - 1):
        check_split(engine, ids, split, [prompt(engine, 99, 30)], tiers="hicache_size" in options)
    engine.close()


def test_what_is_not_invariant_says_so() -> None:
    """Off, and the reference attention backend (gather + SDPA, whose bits depend on the uncached tail's length),
    report it."""
    engine = Engine(max_total_tokens=512, split_invariant=False)
    assert not engine.split_invariant and engine.describe()["split_invariant"] is False
    engine.close()
    engine = Engine(max_total_tokens=512, attention_backend="reference")
    assert not engine.split_invariant and "reference attention backend" in engine.describe()["split_invariant_reason"]
    engine.close()


def test_an_hf_checkpoint_keeps_it_too(tiny_model_dir: Path) -> None:
    """Float linears run the GGUF float rows kernel over their own bytes (before, torch's GEMM: in float32 a cache
    hit changed the first token's logprobs in 10 of 10 random pairs on this model)."""
    engine = Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=2048)
    assert engine.split_invariant, engine.split_invariant_reason
    rng = random.Random(0)
    for _ in range(6):
        ids = [rng.randrange(5, 90) for _ in range(120)]
        check_split(engine, ids, rng.randrange(1, 119), [[rng.randrange(5, 90) for _ in range(30)]])
    engine.close()


def test_a_gguf_kept_as_rows_keeps_it_too() -> None:
    """An F16 GGUF under auto runs its rows (gguf_rows.py) in the rows' kernel at any row count: a tiny llama3
    fixture, prompts of random token ids."""
    engine = Engine(model_path="tests/fixtures/gguf/llama3.gguf", max_total_tokens=1024, dtype="bfloat16")
    assert engine.split_invariant, engine.split_invariant_reason
    rng = random.Random(3)
    ids = [rng.randrange(10, 1000) for _ in range(90)]
    for split in (1, 23, 64, 89):
        check_split(engine, ids, split, [[rng.randrange(10, 1000) for _ in range(20)]])
    engine.close()


def test_the_amx_kernel_is_refused_before_loading_where_amx_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_config, "amx_available", lambda: False)
    with pytest.raises(ValueError, match="amx needs a CPU"):
        EngineConfig(split_invariant_kernel="amx")
    assert EngineConfig(split_invariant_kernel="amx", split_invariant=False).split_invariant_kernel == "amx"


@pytest.mark.skipif(not amx_available(), reason="no AMX-BF16 here")
def test_the_amx_kernel_keeps_it_where_amx_runs() -> None:
    """--split-invariant-kernel amx: the block linears on AMX tiles at every row count (block_amx.cpp)."""
    engine = Engine(max_total_tokens=2048, split_invariant_kernel="amx")
    assert engine.split_invariant and "(amx)" in engine.split_invariant_reason
    ids = prompt(engine, 777, 80)
    for split in (1, 17, len(ids) // 2, len(ids) - 1):
        check_split(engine, ids, split, [prompt(engine, 99, 30)])
    engine.close()
