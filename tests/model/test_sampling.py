"""Sampling: penalties, greedy, top_k / top_p / min_p filters, seeded reproducibility, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from radixserve.core import SamplingParams
from radixserve.model.sampling import SamplingState, sample

PROBS = [0.5, 0.3, 0.15, 0.05]  # a hand-made distribution; logits = log(PROBS)


def logits_of(values: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([values] * rows, dtype=torch.float32)


def state(prompt: tuple[int, ...] = (), **params: Any) -> SamplingState:
    return SamplingState(SamplingParams(**params), prompt)


def draw(values: list[float], n: int = 2000, **params: Any) -> Counter[int]:
    """Counts of tokens over n draws, one row per draw, each row a request with its own seed."""
    states = [state(seed=i, **params) for i in range(n)]
    return Counter(sample(logits_of(values, n), states).token_ids)


def greedy_token(values: list[float], st: SamplingState) -> int:
    return sample(logits_of(values), [st]).token_ids[0]


# ---- greedy --------------------------------------------------------------------------------------


def test_greedy_is_argmax_for_temperature_zero_and_top_k_one() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(dim=-1).tolist()
    for params in ({"temperature": 0.0}, {"top_k": 1}, {"top_k": 1, "temperature": 5.0}):
        states = [state(seed=i, **params) for i in range(8)]
        assert sample(logits, states).token_ids == expected


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    states = [state(temperature=0.0) if i % 2 else state(seed=i) for i in range(6)]
    out = sample(logits, states).token_ids
    assert [out[i] for i in (1, 3, 5)] == logits.argmax(dim=-1)[[1, 3, 5]].tolist()


# ---- filters -------------------------------------------------------------------------------------


def test_top_k_never_draws_outside_the_top_k() -> None:
    values = torch.randn(40, generator=torch.Generator().manual_seed(2)).tolist()
    top3 = set(torch.tensor(values).topk(3).indices.tolist())
    counts = draw(values, top_k=3, temperature=3.0)  # a hot temperature spreads mass to the tail
    assert set(counts) == top3


def test_top_p_draws_only_from_the_nucleus() -> None:
    values = [math.log(p) for p in PROBS]
    assert set(draw(values, top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert set(draw(values, top_p=0.9)) == {0, 1, 2}


def test_tiny_top_p_keeps_exactly_the_argmax() -> None:
    values = torch.randn(100, generator=torch.Generator().manual_seed(3)).tolist()
    counts = draw(values, n=300, top_p=1e-6, temperature=2.0)
    assert set(counts) == {max(range(100), key=values.__getitem__)}


def test_top_p_measures_the_top_k_renormalised_distribution() -> None:
    # top_k=2 leaves [0.4, 0.3] -> [4/7, 3/7]; 4/7 >= 0.5, so the nucleus is token 0 alone.
    # (On the raw distribution, 0.4 < 0.5 would have kept token 1 too.)
    values = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert set(draw(values, top_k=2, top_p=0.5)) == {0}


def test_min_p_drops_tokens_below_the_fraction_of_the_max() -> None:
    values = [math.log(p) for p in PROBS]
    assert set(draw(values, min_p=0.2)) == {0, 1, 2}  # floor 0.1 drops 0.05 only
    assert set(draw(values, min_p=0.5)) == {0, 1}  # floor 0.25 drops 0.15 too


def test_temperature_one_matches_softmax() -> None:
    values = [1.0, 0.5, 0.0, -0.5, -1.5]
    probs = torch.softmax(torch.tensor(values), dim=-1).tolist()
    n = 6000
    counts = draw(values, n=n)
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in enumerate(probs))
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


# ---- penalties -----------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    # Positive: token 0 seen in the prompt, 2.0 / 1.5 = 1.33 < 1.5.
    assert greedy_token([2.0, 1.5, -1.0], state((0,), temperature=0.0, repetition_penalty=1.5)) == 1
    assert greedy_token([2.0, 1.5, -1.0], state((0,), temperature=0.0, repetition_penalty=1.2)) == 0
    # Negative: -1.0 * 1.5 = -1.5 < -1.2 (dividing would have raised it to -0.67).
    assert greedy_token([-1.0, -1.2, -5.0], state((0,), temperature=0.0, repetition_penalty=1.5)) == 1
    assert greedy_token([-1.0, -1.2, -5.0], state((0,), temperature=0.0, repetition_penalty=1.1)) == 0
    # A penalty < 1 rewards seen tokens: token 1's 1.5 / 0.7 = 2.14 > 2.0.
    assert greedy_token([2.0, 1.5, -1.0], state((1,), temperature=0.0, repetition_penalty=0.7)) == 1


def test_repetition_penalty_covers_generated_tokens() -> None:
    st = state(temperature=0.0, repetition_penalty=1.5)
    assert greedy_token([2.0, 1.5, -1.0], st) == 0
    st.append(0)
    assert greedy_token([2.0, 1.5, -1.0], st) == 1


def test_frequency_penalty_scales_with_the_count_of_generated_tokens() -> None:
    values = [3.0, 2.5, 0.0]
    st = state((1,), temperature=0.0, frequency_penalty=0.3)
    st.append(0)
    assert greedy_token(values, st) == 0  # 3.0 - 0.3 = 2.7 > 2.5
    st.append(0)
    assert greedy_token(values, st) == 1  # 3.0 - 0.6 = 2.4 < 2.5
    # Prompt tokens do not count: token 1 sits in the prompt, yet keeps its 2.5.
    st.append(2)
    assert greedy_token([0.0, 2.5, 2.4], st) == 1


def test_presence_penalty_applies_once_whatever_the_count() -> None:
    values = [3.0, 2.5, 0.0]
    st = state(temperature=0.0, presence_penalty=0.4)
    for _ in range(5):
        st.append(0)
    assert greedy_token(values, st) == 0  # 3.0 - 0.4 = 2.6 > 2.5
    st2 = state(temperature=0.0, presence_penalty=0.6, frequency_penalty=0.1)
    st2.append(0)
    assert greedy_token(values, st2) == 1  # 3.0 - (0.1 * 1 + 0.6) = 2.3 < 2.5


def test_penalties_do_not_modify_the_callers_logits() -> None:
    logits = logits_of([2.0, 1.5, -1.0])
    before = logits.clone()
    sample(logits, [state((0,), temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)])
    assert torch.equal(logits, before)


# ---- seeds ---------------------------------------------------------------------------------------

FANCY: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 20,
    "top_p": 0.9,
    "min_p": 0.02,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.2,
    "presence_penalty": 0.1,
}
OTHERS: list[dict[str, Any]] = [  # companions that use every path the target does not
    {"temperature": 0.0},
    {"temperature": 1.3},
    {"top_k": 5},
    {"top_p": 0.5, "seed": 7},
    {"min_p": 0.3, "frequency_penalty": 1.0},
    {},
]


def run_steps(params: dict[str, Any], companions: list[dict[str, Any]], position: int, steps: int = 12) -> list[int]:
    """The tokens one request draws over ``steps``, batched with ``companions`` at ``position``."""
    vocab = 64
    target = state((1, 2, 3), **params)
    others = [state((5,), **p) for p in companions]
    batch = others[:position] + [target] + others[position:]
    tokens = []
    noise = torch.Generator().manual_seed(1234)  # the other rows' logits differ per layout
    for step in range(steps):
        logits = torch.randn(len(batch), vocab, generator=noise) * 3
        logits[position] = torch.randn(vocab, generator=torch.Generator().manual_seed(step)) * 2
        out = sample(logits, batch)
        for st, tok in zip(batch, out.token_ids):
            st.append(tok)
        tokens.append(out.token_ids[position])
    return tokens


@pytest.mark.parametrize("params", [{"seed": 42, **FANCY}, {"seed": 42}], ids=["filters", "plain"])
def test_same_seed_same_tokens_whatever_the_batch(params: dict[str, Any]) -> None:
    alone = run_steps(params, [], 0)
    assert len(set(alone)) > 3  # it really samples
    assert run_steps(params, OTHERS, 0) == alone
    assert run_steps(params, OTHERS, 3) == alone
    assert run_steps(params, OTHERS[:2], 2) == alone


def test_different_seeds_give_different_tokens() -> None:
    runs = [run_steps({"seed": seed}, [], 0) for seed in range(4)]
    assert len({tuple(r) for r in runs}) == 4


def test_sample_reads_the_state_and_only_append_advances_it() -> None:
    """The step may sample one state twice (a batch retried row by row): the same token both times."""
    st = state(seed=3, temperature=5.0, frequency_penalty=0.5)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    drawn = {sample(logits, [st]).token_ids[0] for _ in range(8)}
    assert len(drawn) == 1
    st.append(drawn.pop())
    assert len({sample(logits, [st]).token_ids[0] for _ in range(8)}) == 1


def test_no_seed_draws_a_fresh_one_per_request() -> None:
    assert len({state().seed for _ in range(8)}) == 8
    assert state(seed=5).seed == 5


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits_at_the_chosen_token() -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    states = [state((0, 1), logprobs=True, seed=i, **FANCY) for i in range(3)] + [state(seed=3)]
    out = sample(logits, states)
    assert out.logprobs is not None and out.logprobs[3] is None  # row 3 did not ask
    expected = torch.log_softmax(logits, dim=-1)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(expected[i, out.token_ids[i]].item(), abs=1e-6)
    assert sample(logits, [state(seed=i) for i in range(4)]).logprobs is None


def test_top_logprobs_rank_the_raw_distribution_per_row() -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    states = [state(top_logprobs=5, temperature=0), state(top_logprobs=2, seed=1), state(seed=2)]
    out = sample(logits, states)
    assert out.top_logprobs is not None and out.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)
    for row, k in enumerate([5, 2, 0]):
        values, ids = expected[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy picks the top one
    assert out.logprobs[2] is None and SamplingParams(top_logprobs=3).logprobs  # top_logprobs implies logprobs
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("logits", "num_states", "match"),
    [
        (torch.zeros(4), 4, "batch, vocab"),
        (torch.zeros(2, 3, 4), 2, "batch, vocab"),
        (torch.zeros(2, 0), 2, "batch, vocab"),
        (torch.zeros(3, 8), 2, "3 rows but 2 states"),
        (torch.zeros(2, 8, dtype=torch.long), 2, "floating point"),
    ],
)
def test_bad_input_raises(logits: torch.Tensor, num_states: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sample(logits, [state() for _ in range(num_states)])


def test_out_of_vocab_token_ids_raise() -> None:
    with pytest.raises(ValueError, match="prompt token ids"):
        sample(torch.zeros(1, 8), [state((3, 8), repetition_penalty=1.2)])
    st = state(frequency_penalty=0.5)
    st.append(9)
    with pytest.raises(ValueError, match="generated token ids"):
        sample(torch.zeros(1, 8), [st])
    with pytest.raises(ValueError, match=">= 0"):
        st.append(-1)
