"""The n-gram index over the prefix cache (drafts for speculative decoding), prompt lookup, and the draft verifier.

The index is checked against the tree after every insert and eviction: whatever it holds is cached, in the
same namespace, right now (it keeps copies of token ids, bounded, and drops them as the tree frees them).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from radixserve.cache import RadixCache, RadixKey, TokenAllocator
from radixserve.core import SamplingParams
from radixserve.model.grammar import GrammarCompiler, GrammarState
from radixserve.model.sampling import SamplingState
from radixserve.model.spec_verify import verify
from radixserve.scheduler.draft import (
    ROW_COST,
    ROW_TILE,
    TILE_ROWS,
    Drafter,
    VerifyCosts,
    best_draft_len,
    continuations,
    prompt_lookup,
)
from radixserve.scheduler.ngram import NgramIndex
from radixserve.scheduler.request import Request
from tests.support.tiny_model import BYTE_EOS, BYTE_VOCAB

CITY_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    }
)


def cached_sequences(cache: RadixCache) -> list[RadixKey]:
    """Every root-to-leaf path of the tree, as keys (brute force)."""
    return [cache.path_key(node) for node in cache.nodes() if not node.children and node is not cache.root]


def check_index(index: NgramIndex, cache: RadixCache) -> None:
    """Every entry: its n-gram, then its continuation, occurs in a cached sequence of its namespace."""
    sequences = [(key.extra_key, key.token_ids.tolist()) for key in cached_sequences(cache)]
    for (namespace, ngram), (pos, cont) in index._entries.items():
        run = [*ngram, *cont]
        start = pos - len(ngram) + 1
        assert any(ns == namespace and tokens[start : start + len(run)] == run for ns, tokens in sequences), (
            namespace,
            ngram,
            pos,
            cont,
        )


def test_lookup_prefers_the_longest_ngram_and_returns_its_continuation() -> None:
    index = NgramIndex(max_continuation=4)
    cache = RadixCache(TokenAllocator(256), listeners=[index])
    seq = [5, 6, 7, 8, 9, 10, 11, 1, 2, 7, 8, 30]
    cache.insert(RadixKey(seq), cache.allocator.alloc(len(seq)))
    assert index.lookup(None, [0, 6, 7, 8], 8) == (3, [9, 10, 11, 1])  # 6 7 8 -> 9 ..., not 7 8 -> 30
    assert index.lookup(None, [1, 2, 7, 8], 2) == (4, [30])
    assert index.lookup(None, [99, 98], 4) == (0, [])
    assert index.lookup("tenant", [0, 6, 7, 8], 4) == (0, [])  # another namespace sees nothing
    check_index(index, cache)


@pytest.mark.parametrize("seed", range(4))
def test_index_never_holds_what_the_tree_freed(seed: int) -> None:
    """Random inserts (shared prefixes, two namespaces) and evictions; after each, the index is checked."""
    rng = random.Random(seed)
    index = NgramIndex(max_continuation=3, max_entries=400, sizes=(3, 2))
    allocator = TokenAllocator(96)
    cache = RadixCache(allocator, listeners=[index])
    chunks = [[rng.randrange(6) for _ in range(rng.randrange(1, 6))] for _ in range(8)]
    for _ in range(60):
        if rng.random() < 0.6:
            tokens = [t for _ in range(rng.randrange(1, 5)) for t in rng.choice(chunks)]
            key = RadixKey(tokens, rng.choice([None, "a"]))
            slots = cache.alloc_slots(len(tokens))
            if slots is not None:
                done = cache.insert(key, slots)
                allocator.free(slots[:done])
        else:
            cache.evict(rng.randrange(1, 20))
        cache.check_invariants()
        check_index(index, cache)
        assert len(index) <= 400
    cache.evict(cache.evictable_size())
    assert len(index) == 0  # the tree is empty: so is the index


def test_prompt_lookup_takes_the_latest_earlier_occurrence() -> None:
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert prompt_lookup(tokens, 3) == (3, [4, 5, 1])
    assert prompt_lookup(np.array([7, 8, 9]), 3) == (0, [])
    assert continuations(tokens, 1, 2, count=3) == [[4, 5], [9, 1]]  # after each earlier 3, the latest first


@pytest.fixture(scope="module")
def city(byte_model_dir: Path) -> tuple[Callable[[str], list[int]], Callable[[str], GrammarState]]:
    """(text -> byte-model token ids, answer so far -> a CITY_SCHEMA matcher that has taken it)."""
    tokenizer = AutoTokenizer.from_pretrained(byte_model_dir)
    compiler = GrammarCompiler(tokenizer, BYTE_VOCAB, [BYTE_EOS])
    compiled = compiler.compile("json_schema", CITY_SCHEMA)

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def matcher(answer: str) -> GrammarState:
        grammar = compiler.matcher(compiled)
        for token in ids(answer):
            grammar.accept(token)
        return grammar

    return ids, matcher


def test_grammar_lookup_drafts_only_what_the_grammar_admits(city: tuple[Callable, Callable]) -> None:
    """After ``"Lima"`` no n-gram has occurred before; of the earlier occurrences of its last token (the quote),
    the latest seven go on where the grammar does not (``:``, ``L``, ``}``, ``c``, ...), the eighth, after
    ``"Paris"``, goes on as the grammar must: its continuation is drafted, cut where the grammar stops admitting
    it (``k``: not in the unit enum); the request's matcher is left where it was."""
    ids, matcher = city
    answer = '{"city": "Lima"'
    req = Request(0, np.array(ids('{"city": "Paris", "unit": "kelvin"}\n')), SamplingParams(), grammar=matcher(answer))
    req.output_ids = ids(answer)
    grammar, tokens = req.sampling.grammar, req.fill_ids
    assert grammar is not None and prompt_lookup(tokens, 8) == (0, [])
    drafter = Drafter(8, None)
    assert drafter._grammar_lookup(req, grammar, tokens, 8) == ids(', "unit"')
    assert drafter._grammar_lookup(req, grammar, tokens, 16) == ids(', "unit": "')  # not the k
    rest = ids(', "unit": "celsius"}')
    assert grammar.accepted_len(rest + ids("x")) == len(rest)  # untouched by the tries: the answer goes on
    for token in rest:
        grammar.accept(token)
    assert grammar.accepted_len(ids("x")) == 0


def test_only_a_grammar_request_drafts_from_one_token(city: tuple[Callable, Callable]) -> None:
    """The tree holds an earlier ``Oslo, "unit": ...``; after ``"Lima",`` nothing of 2-4 tokens matches. Without
    a grammar a one-token match drafts nothing (free text: it lost); with one, what followed the comma is
    drafted, the grammar admitting it."""
    ids, matcher = city
    index = NgramIndex()
    cache = RadixCache(TokenAllocator(256), listeners=[index])
    earlier = ids('Oslo, "unit": "fahrenheit"')
    cache.insert(RadixKey(earlier), cache.allocator.alloc(len(earlier)))
    answer = '{"city": "Lima",'
    prompt = np.array(ids("Weather in Lima?"))
    plain = Request(0, prompt, SamplingParams(max_new_tokens=64))
    constrained = Request(1, prompt, SamplingParams(max_new_tokens=64), grammar=matcher(answer))
    drafter = Drafter(8, index)
    for req in (plain, constrained):
        req.output_ids = ids(answer)
    assert drafter._copy(plain, plain.fill_ids, None, 8) == []
    grammar = constrained.sampling.grammar
    assert drafter._copy(constrained, constrained.fill_ids, grammar, 16) == ids(' "unit":')  # max_continuation
    assert Drafter(8, None)._copy(constrained, constrained.fill_ids, grammar, 8) == []  # its own text: no comma
    check_index(index, cache)


def test_a_grammar_request_drafts_what_its_grammar_forces_first(city: tuple[Callable, Callable]) -> None:
    """After ``"Lima"`` the byte model's grammar admits one token at a time up to the unit's value: those come
    first (certain), then what followed them in the tree (an earlier answer); a rejected proposal leaves the
    request's matcher as it was."""
    ids, matcher = city
    grammar = matcher('{"city": "Lima"')
    assert grammar.forced_tokens(16) == ids(', "unit": "') and grammar.forced_tokens(3) == ids(', "')
    assert matcher('{"city": "Li').forced_tokens(8) == []  # inside a string: any character
    index = NgramIndex()
    cache = RadixCache(TokenAllocator(256), listeners=[index])
    earlier = ids('{"city": "Oslo", "unit": "fahrenheit"}')
    cache.insert(RadixKey(earlier), cache.allocator.alloc(len(earlier)))
    req = Request(0, np.array(ids("Weather in Lima?")), SamplingParams(max_new_tokens=64), grammar=grammar)
    req.output_ids = ids('{"city": "Lima"')
    drafter = Drafter(16, index)
    drafter.state(req).trials = 1.0  # every recent draft accepted: all pay
    assert drafter.propose(req, 8, drafter.price(1, 1)) == ids(', "unit"')  # room for 8
    assert drafter.propose(req, 16, drafter.price(1, 1)) == ids(', "unit": "fahre')  # then the tree's copy
    drafter.record(req, 16, 0)  # none accepted (as if the model wrote something else)
    rest = ids(', "unit": "celsius"}')
    assert grammar.accepted_len(rest) == len(rest)


def test_forced_tokens_pay_through_a_cooldown_and_teach_the_estimate_nothing(city: tuple[Callable, Callable]) -> None:
    """Forced tokens are certain: drafted while a cooldown holds the copies back and while the estimate says no
    copy pays, as long as a row costs less than a token (not at a price of 1.5 tokens a row); their acceptance
    leaves the copies' estimate where it was."""
    ids, matcher = city
    req = Request(
        0, np.array(ids("Weather in Lima?")), SamplingParams(max_new_tokens=64), grammar=matcher('{"city": "Lima"')
    )
    req.output_ids = ids('{"city": "Lima"')
    drafter = Drafter(16, None, use_prompt=False)
    spec = drafter.state(req)
    spec.accepted, spec.trials, spec.cooldown = 0.0, 8.0, 3  # copies have not paid lately: a cooldown runs
    forced = ids(', "unit": "')
    assert drafter.propose(req, 16, drafter.price(1, 1)) == forced and spec.cooldown == 2
    assert drafter.propose(req, 16, 1.5 / ROW_COST) == [] and spec.cooldown == 1  # a row: 1.5 tokens
    spec.cooldown = 0
    assert drafter.propose(req, 16, drafter.price(1, 1)) == forced and spec.forced == len(forced)
    drafter.record(req, len(forced), len(forced))
    assert (spec.accepted, spec.trials) == (0.0, 8.0) and spec.num_accepted_tokens == len(forced)


def empirical_vs_expected(counts: dict[object, int], expected: dict[object, float]) -> float:
    """The chi-square goodness-of-fit p-value of ``counts`` against probabilities ``expected`` (cells with an
    expected count under 5 pooled)."""
    total = sum(counts.values())
    cells, small_obs, small_exp = [], 0, 0.0
    for cell, p in expected.items():
        if p * total >= 5:
            cells.append((counts.get(cell, 0), p * total))
        else:
            small_obs, small_exp = small_obs + counts.get(cell, 0), small_exp + p * total
    if small_exp > 0:
        cells.append((small_obs, small_exp))
    stat = sum((obs - exp) ** 2 / exp for obs, exp in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_rejection_sampling_keeps_the_distribution() -> None:
    """verify() with two drafts, many seeds: the joint law of the taken tokens is what sampling step by step
    gives (first token ~ p0; after an accepted draft, the next ~ p1; the bonus after both ~ p2)."""
    torch.manual_seed(0)
    vocab, drafts = 5, [1, 3]
    logits = torch.randn(3, vocab) * 1.5
    p = torch.softmax(logits, dim=-1).tolist()
    expected: dict[object, float] = {}
    for a in range(vocab):
        if a != drafts[0]:
            expected[(a,)] = p[0][a]
            continue
        for b in range(vocab):
            if b != drafts[1]:
                expected[(a, b)] = p[0][a] * p[1][b]
                continue
            for c in range(vocab):
                expected[(a, b, c)] = p[0][a] * p[1][b] * p[2][c]
    counts: dict[object, int] = {}
    for seed in range(6000):
        state = SamplingState(SamplingParams(temperature=1.0, seed=seed), [0])
        out = tuple(verify(logits, drafts, state).token_ids)
        counts[out] = counts.get(out, 0) + 1
    assert set(counts) <= set(expected)
    assert empirical_vs_expected(counts, expected) > 1e-3


def test_greedy_verify_takes_the_argmax_prefix_and_leaves_the_state() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    state = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=1.5), [0])
    assert verify(logits, [1, 0], state).token_ids == [1, 0, 2]  # both accepted, then the bonus
    assert verify(logits, [1, 2], state).token_ids == [1, 0]  # the second replaced by the argmax
    assert verify(logits, [2, 0], state).token_ids == [1]
    assert state._pending == [] and (state._seen is None or not state._seen[1:].any())  # untouched


def test_draft_length_pays_only_where_it_gains() -> None:
    drafter = Drafter(8, None)
    alone, batch16, beside_prefill = drafter.price(1, 1), drafter.price(16, 16), drafter.price(1, 513)
    assert best_draft_len(0.9, 8, alone) >= 4
    assert best_draft_len(0.15, 8, alone) == 0  # prose: drafting would cost more than it saves
    assert 0.75 < batch16 * ROW_COST < 0.8  # a row there costs most of a token
    assert best_draft_len(0.75, 8, batch16) == 0  # a large batch already makes many tokens per step
    assert best_draft_len(1.0, 7, batch16) == 7
    assert best_draft_len(0.5, 8, beside_prefill) >= 4  # the decoders wait on a prefill chunk anyway


def test_a_draft_that_opens_a_row_tile_pays_for_it() -> None:
    """Rows share some decode kernels' weight decode ROW_TILE at a time: the modelled costs price a draft whose row
    opens a tile TILE_ROWS rows more (here at five decodes' price: a row costs about half a token)."""
    few = Drafter(8, None).price(5, 5)
    assert ROW_TILE == 8 and TILE_ROWS > 0 and 0.5 < few * ROW_COST < 1
    assert best_draft_len(1.0, 8, few) == 7  # an eighth draft is the step's ninth row: a second tile
    assert best_draft_len(1.0, 7, few, first_row=1) == 6  # a request after one other: its seventh opens it
    assert best_draft_len(1.0, 8, few, costs=VerifyCosts.modelled(ROW_COST * 0.2)) == 8  # cheap rows: worth it
    assert best_draft_len(1.0, 5, few, first_row=3) == 4  # 3 + 5 = 8: the fifth draft would open it
    assert best_draft_len(1.0, 8, few, first_row=3) == 8  # unless enough drafts follow it in the new tile
    assert best_draft_len(1.0, 8, Drafter(8, None).price(1, 1)) == 8  # alone, eight drafts pay for the tile


def test_measured_costs_price_what_rows_cost_here() -> None:
    """A measured table (seconds, any unit) becomes decode steps, never falls with more rows, is linear between its
    row counts and past the last at the last slope; drafts are priced by it: where rows are nearly free (a GPU)
    every draft with a chance pays, where they cost a step each (a slow CPU kernel) none does."""
    costs = VerifyCosts([(1, 0.010), (2, 0.013), (3, 0.012), (5, 0.020), (9, 0.030)], source="measured")
    assert costs.at(1) == 1.0 and costs.at(3) == costs.at(2) == pytest.approx(1.3)  # 3 rows timed faster: noise
    assert costs.at(4) == pytest.approx(1.65) and costs.at(9) == pytest.approx(3.0)
    assert costs.at(13) == pytest.approx(4.0) and costs.at(500) == pytest.approx(3.0 + 491 * 0.25)
    assert costs.drafts(0, 2) == pytest.approx(0.3) and costs.drafts(1, 2) == pytest.approx(0.35)
    assert costs.row_cost() == pytest.approx(0.25)
    gpu = VerifyCosts([(1, 1.0), (9, 1.02), (36, 1.1)], source="measured")
    slow = VerifyCosts([(1, 1.0), (9, 9.0)], source="measured")
    alone = Drafter(8, None, costs=gpu).price(1, 1)
    assert best_draft_len(0.7, 8, alone, costs=gpu) == 8
    assert best_draft_len(0.7, 8, alone, costs=VerifyCosts.modelled()) == 4
    assert best_draft_len(0.95, 8, Drafter(8, None, costs=slow).price(1, 1), costs=slow) == 0
    assert Drafter(8, None, costs=gpu).costs is gpu and Drafter(8, None).costs.source == "modelled"
    with pytest.raises(ValueError, match="row counts from 1"):
        VerifyCosts([(2, 1.0), (4, 2.0)])


def test_no_probe_at_a_large_batch() -> None:
    """A request whose drafts do not pay waits, then probes one token alone; at batch 16 it never probes."""
    index = NgramIndex()
    drafter = Drafter(8, index)
    req = Request(0, np.array([5, 6, 7, 8, 5, 6, 7]), SamplingParams(max_new_tokens=64))
    req.output_ids = [8]
    spec = drafter.state(req)
    spec.accepted, spec.trials = 0.1, 4.0  # drafts have kept failing
    alone, batch16 = drafter.price(1, 1), drafter.price(16, 16)
    assert drafter.propose(req, 8, alone) == []  # the cooldown starts
    assert spec.cooldown == 1 and spec.probe
    assert drafter.propose(req, 8, alone) == []  # waits it out
    assert drafter.propose(req, 8, batch16) == []  # no probe at batch 16: a longer wait instead
    assert spec.cooldown == 2
    assert drafter.propose(req, 8, alone) == drafter.propose(req, 8, alone) == []
    assert drafter.propose(req, 8, alone) == [5]  # the probe: one token, from prompt lookup (8 -> 5)
