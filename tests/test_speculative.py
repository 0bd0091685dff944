"""Speculative decoding (``--speculative-algorithm ngram``) changes no answer: greedy output is token for token a
plain run's, for every request of a batch, in the default dtype (bfloat16 here) and in float32; sampled output
keeps its distribution; rejected drafts' slots are freed at once and no lock is left.

Why greedy identity holds bit for bit: the verify rows run as one-token decode rows (model/runner.py
``_decode_rows``), each on the context up to itself, so each row's logits are what a plain decode step computes
(an extend's rows differ from a decode's in the last bfloat16 bits: the paged kernel's multi-row path)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.engine.spec_costs import timed_rows
from radixserve.model.runner import StepInput
from radixserve.scheduler.batch import ScheduledBatch, StepOutput
from radixserve.scheduler.draft import Drafter
from radixserve.scheduler.request import Request
from radixserve.server.metrics import ServerMetrics

CODE = Path(__file__).with_name("test_core.py").read_text()[:900]
PROMPTS = [  # the long one last: its prefill chunks run beside the others' decodes and verifies
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Repeat after me three times: the cat sat on the mat by the door."}],
    [{"role": "user", "content": "List the numbers from 1 to 30, separated by commas."}],
    [{"role": "user", "content": "Copy this code exactly:\n" + CODE}],
]
GREEDY = {"max_new_tokens": 48, "temperature": 0.0}


class StepLog:
    """Wraps the scheduler's process(): records each batch's entry modes, checks slot conservation each step."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.modes = engine, []
        self._process = engine.scheduler.process
        engine.scheduler.process = self.process  # type: ignore[method-assign]

    def process(self, batch: ScheduledBatch, outputs: list[StepOutput]) -> list[Request]:
        self.modes.append({entry.mode for entry in batch.entries})
        finished = self._process(batch, outputs)
        engine = self.engine
        engine.cache.check_invariants()
        page = engine.allocator.page_size  # a request owns its partial last page whole
        running = [r.kv for r in engine.scheduler.running if r.kv is not None]
        private = sum(-(-(len(kv.kv_indices) - kv.cache_protected_len) // page) * page for kv in running)
        free, cached = engine.allocator.free_size(), engine.cache.total_size()
        assert free + cached + private == engine.allocator.size, "a KV slot leaked (or was freed twice)"
        return finished


def generate(engine: Engine, speculate: bool, params: list[dict[str, object]]) -> list[list[int]]:
    drafter = engine.drafter
    engine.scheduler.drafter = drafter if speculate else None
    try:
        engine.flush_cache()
        prompts = [engine.tokenizer.apply_chat_template(m) for m in PROMPTS]
        first = engine.generate(input_ids=prompts, sampling_params=params)
        again = engine.generate(input_ids=prompts, sampling_params=params)  # now the tree holds the answers
        engine.check_idle_invariants()
        return [r.output_ids for r in first + again]
    finally:
        engine.scheduler.drafter = drafter


@pytest.fixture(scope="module", params=["auto", "float32"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    # Small chunks with mixed steps: prefill chunks share steps with decodes and verifies.
    engine = Engine(
        dtype=request.param,
        max_total_tokens=4096,
        speculative_algorithm="ngram",
        enable_mixed_chunk=True,
        chunked_prefill_size=32,
    )
    yield engine
    engine.close()


def test_greedy_output_is_a_plain_runs(engine: Engine) -> None:
    params = [dict(GREEDY) for _ in PROMPTS]
    params[1]["stop"] = ["door"]  # a stop string inside a run of accepted drafts
    params[2]["max_new_tokens"] = 21
    log = StepLog(engine)
    plain = generate(engine, False, params)
    spec = generate(engine, True, params)
    assert spec == plain
    assert {"verify", "decode", "extend"} <= set().union(*log.modes)
    assert any({"verify", "extend"} <= modes for modes in log.modes)  # drafts verified beside a prefill chunk
    stats = engine.scheduler.stats
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens


def test_meta_info_counts_drafts(engine: Engine) -> None:
    engine.flush_cache()
    ids = engine.tokenizer.apply_chat_template(PROMPTS[-1])
    meta = engine.generate(input_ids=ids, sampling_params=GREEDY).to_dict()["meta_info"]
    assert meta["spec_draft_tokens"] >= meta["spec_accept_tokens"] > 0
    assert meta["spec_accept_length"] > 1.0
    snapshot = engine.snapshot()  # /server_info's scheduler figures
    assert snapshot["avg_spec_accept_length"] is not None and snapshot["avg_spec_accept_length"] > 1.0
    assert snapshot["spec_draft_tokens"] >= snapshot["spec_accepted_tokens"] > 0


def test_prometheus_counts_drafts() -> None:
    metrics = ServerMetrics()
    metrics.on_finish(40, 0, 12, "stop", 0.5, spec=(10, 6))
    metrics.on_finish(40, 0, 12, "stop", 0.5)
    text = metrics.render().decode()
    assert "radixserve:spec_decode_num_draft_tokens_total 10.0" in text
    assert "radixserve:spec_decode_num_accepted_tokens_total 6.0" in text


class GreedyPathDrafter(Drafter):
    """Drafts the rest of a fixed token path while the output follows it: drafts that are often right and
    sometimes wrong, whatever the model, so both the accept and the reject paths run."""

    def __init__(self, path: list[int]) -> None:
        super().__init__(len(path), None, use_prompt=False, max_step_drafts=1 << 12)
        self.path = path

    def propose(self, req: Request, room: int, price: float, first_row: int = 0) -> list[int]:
        done = len(req.output_ids)
        if req.output_ids != self.path[:done]:
            return []
        return self.path[done : done + min(room, req.params.max_new_tokens - done - 1)]


def two_sample_p(a: list[object], b: list[object]) -> float:
    """Chi-square test of homogeneity (cells with fewer than 10 in all pooled): the p-value."""
    cells = sorted(set(a) | set(b), key=repr)
    rows = np.array([[a.count(c) for c in cells], [b.count(c) for c in cells]], dtype=float)
    big = rows.sum(axis=0) >= 10
    rows = np.concatenate([rows[:, big], rows[:, ~big].sum(axis=1, keepdims=True)], axis=1)
    rows = rows[:, rows.sum(axis=0) > 0]
    expected = rows.sum(axis=1, keepdims=True) * rows.sum(axis=0, keepdims=True) / rows.sum()
    stat = float(((rows - expected) ** 2 / expected).sum())
    df = rows.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_sampled_output_keeps_its_distribution(tiny_model_dir: Path) -> None:
    """The tiny random model at temperature 0.15: the first three tokens of 400 seeded requests with drafts
    (rejection sampling) against 400 without, as whole triples and as the third token alone."""
    engine = Engine(model_path=str(tiny_model_dir), dtype="float32", speculative_algorithm="ngram")
    prompt = [5, 9, 14, 5, 9]
    path = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, "temperature": 0}).output_ids
    drafter = GreedyPathDrafter(path)

    def run(speculate: bool, seeds: range) -> list[tuple[int, ...]]:
        engine.scheduler.drafter = drafter if speculate else None
        params = [{"max_new_tokens": 3, "temperature": 0.15, "seed": s} for s in seeds]
        return [tuple(r.output_ids) for r in engine.generate(input_ids=[prompt] * len(seeds), sampling_params=params)]

    plain, spec = run(False, range(400)), run(True, range(1000, 1400))
    stats = engine.scheduler.stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # both paths ran
    assert two_sample_p(plain, spec) > 1e-3
    assert two_sample_p([t[2:3] for t in plain], [t[2:3] for t in spec]) > 1e-3
    engine.check_idle_invariants()
    engine.close()


def test_timed_row_counts_cover_the_drafts_and_a_tile_edge() -> None:
    assert timed_rows(8) == [1, 2, 4, 8, 9, 18]
    assert timed_rows(16) == [1, 2, 4, 8, 9, 17, 34]
    assert timed_rows(1) == [1, 2, 4]


def test_verify_costs_are_measured_at_start(engine: Engine, tiny_model_dir: Path) -> None:
    """The engine times verify forwards of 1, 2, 4, 8, 9 and 18 rows before any request and prices drafts by them: on a
    CPU SmolLM2's 9 rows cost well over one decode step; the timed slots go back to the pool; a fixed row cost
    (``speculative_row_cost``) or a pool with no room for the timing keeps the modelled costs."""
    costs = engine.drafter.costs if engine.drafter else None
    assert costs is not None and costs.source == "measured"
    assert [n for n, _ in costs.points] == [1, 2, 4, 8, 9, 18]
    steps = [cost for _, cost in costs.points]
    assert steps[0] == 1 and steps == sorted(steps)
    if engine.device.type == "cpu":
        assert costs.at(9) > 1.5
    assert engine.describe()["speculative_verify_costs"]["steps_by_rows"]["9"] == round(costs.at(9), 3)
    options = {"model_path": str(tiny_model_dir), "dtype": "float32", "speculative_algorithm": "ngram"}
    tiny = Engine(**options, max_total_tokens=256)
    assert tiny.drafter is not None and tiny.drafter.costs.source == "measured"
    assert tiny.allocator.free_size() == tiny.allocator.size  # nothing kept
    tiny.close()
    fixed = Engine(**options, max_total_tokens=256, speculative_row_cost=0.5)
    assert fixed.drafter is not None and fixed.drafter.costs.source == "modelled"
    assert fixed.drafter.costs.at(3) == 2.0
    fixed.close()
    cramped = Engine(**options, max_total_tokens=32)  # no room for 16 tokens of context and 18 rows
    assert cramped.drafter is not None and cramped.drafter.costs.source == "modelled"
    assert cramped.allocator.free_size() == cramped.allocator.size
    cramped.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_drafts_in_a_tight_pool_with_pages(tiny_model_dir: Path, page_size: int) -> None:
    """A pool with little room beyond the decodes' own and partial pages: drafts only where free slots are, rejected
    ones' pages freed (a page's unused tail stays the request's), the same answers, nothing leaked."""
    engine = Engine(
        model_path=str(tiny_model_dir),
        dtype="float32",
        speculative_algorithm="ngram",
        max_total_tokens=128,
        page_size=page_size,
    )
    StepLog(engine)  # conservation after every step
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(8)] * 3 for _ in range(3)]  # 3 x 36 tokens in 128 slots
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.scheduler.stats.spec_draft_tokens > 0
    engine.scheduler.drafter = None
    engine.flush_cache()
    plain = engine.generate(input_ids=prompts, sampling_params=params)
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    engine.check_idle_invariants()
    engine.close()


def test_grammar_holds_with_drafts(byte_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON schema on the tiny byte model, drafts from the prompt (which holds answers of the same shape): the
    grammar masks each verified row as it would the plain step's (a forked matcher walks the drafts), so the
    output is the plain run's, token for token, and valid; the request's own matcher is never left mid-draft.
    Drafts include the grammar's one-token fallback (after a value the model made up, no n-gram matches)."""
    fallbacks: list[list[int]] = []
    lookup = Drafter._grammar_lookup

    def grammar_lookup(*args: Any) -> list[int]:
        drafts = lookup(*args)
        fallbacks.append(drafts)
        return drafts

    monkeypatch.setattr(Drafter, "_grammar_lookup", grammar_lookup)
    engine = Engine(model_path=str(byte_model_dir), dtype="float32", speculative_algorithm="ngram")
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        }
    )
    prompt = '{"name": "ab", "n": 12}\n' * 4
    params = [{"json_schema": schema, "max_new_tokens": 64, "temperature": t, "seed": 1} for t in (0.0, 0.7)]
    spec = engine.generate([prompt, prompt], params)
    drafted = engine.scheduler.stats.spec_draft_tokens
    engine.scheduler.drafter = None
    engine.flush_cache()
    plain = engine.generate([prompt, prompt], params)
    assert drafted > 0 and any(fallbacks)
    assert spec[0].output_ids == plain[0].output_ids
    for out in spec:
        if out.finish_reason == "stop":
            json.loads(out.text)
    engine.check_idle_invariants()
    engine.close()


def test_verify_rows_are_decode_rows_bit_for_bit(engine: Engine) -> None:
    """The logits of a verify entry's rows (its newest token and 5 drafts, in one forward beside another request)
    equal, bit for bit, those of six plain decode steps on the same K/V: why greedy identity holds exactly."""
    runner, allocator = engine.executor.runner, engine.allocator
    prompt = np.arange(300, 600, dtype=np.int64)
    slots = allocator.alloc(len(prompt) + 6 + 40)
    assert slots is not None
    try:
        ctx, other = slots[: len(prompt) + 6], slots[len(prompt) + 6 :]
        runner.forward([StepInput(prompt, ctx[: len(prompt)]), StepInput(prompt[:40], other)], "extend")
        new = np.array([11, 12, 13, 14, 15, 16])
        plain = [runner.forward([StepInput(new[j : j + 1], ctx[: len(prompt) + j + 1])], "decode")[0] for j in range(6)]
        inputs = [StepInput(new, ctx, num_draft_tokens=5), StepInput(prompt[39:40], other)]
        verified = runner.forward(inputs, "mixed", logit_rows=[6, 1])
        assert all(torch.equal(verified[j], plain[j]) for j in range(6))
    finally:
        allocator.free(slots)
