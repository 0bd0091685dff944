"""Pick each request's next token from its logits row: penalties, then greedy or filtered sampling.

Per row, in this order (a step whose parameter is neutral leaves the row unchanged)::

    raw logits -> repetition penalty (prompt + output; CTRL) -> frequency/presence (output; OpenAI)
      -> grammar mask (constrained rows: disallowed tokens -inf; one bitmask for the batch, see grammar.py)
      greedy (temperature == 0 or top_k == 1):  argmax, no randomness consumed
      otherwise: / temperature -> softmax -> top_k -> top_p -> min_p -> multinomial(row's generator)

Reproducibility: a row draws only from its request's own generator, every operation is
row-wise, and a filter the row does not use is an exact no-op on it, so a seeded request
gets the same tokens whatever else is in its batch and at whatever position (given the
same logits row: a model whose logits depend on the batch is a separate matter).

State: ``sample`` reads each request's ``SamplingState`` and returns tokens; only
``SamplingState.append``, once per taken token, advances it (the engine's output stage
calls it). A draw starts from the generator position the last taken token left, so sampling
one state twice (a batch retried row by row) gives the same token. What ``sample`` touches
besides (the generator it draws with, penalty tensors that catch up with appended tokens)
are caches of that state, not changes to it.

Device: the generator lives on the logits' device (created at the first step), so sampling
never copies a vocabulary-sized row to the host. The price: one seed gives different
streams on CPU and CUDA; reproducibility holds per device type.
"""

from __future__ import annotations

import copy
import hashlib
import math
import secrets
from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixserve.core import SamplingParams, TopLogprobs
from radixserve.model.grammar import GrammarState, apply_masks


def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a generator on ``device`` is given for a request's ``seed``. torch's CPU generator (mt19937) keeps
    only a seed's low 32 bits, so seeds 0 and 2^32 drew the same numbers: on the CPU a seed of 2^32 or more is
    hashed to 32 bits (smaller ones are kept as they are), so seeds that differ draw differently but for chance
    collisions (2^-32). CUDA's generator (Philox) takes the whole 64 bits."""
    if device.type != "cpu" or 0 <= seed < 2**32:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(16, "little", signed=True), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class SampleOutput(NamedTuple):
    token_ids: list[int]  # one per row
    # Per row: log_softmax(raw logits) at the chosen token, or None where that row did not
    # ask; the whole field is None when no row asked.
    logprobs: list[float | None] | None
    # Per row: its params.top_logprobs most likely (token id, logprob) pairs, best first
    # (empty where it asked for none); None when no row asked.
    top_logprobs: list[TopLogprobs] | None = None


class SamplingState:
    """One request's sampling state: its params, its seed, its tokens so far (penalty counts), its grammar.

    Call ``append(token_id)`` once per generated token: the one call that advances it. Penalty
    bookkeeping is O(new tokens) per step: appended ids wait in a short list and are added, at
    the next ``sample``, to per-vocabulary tensors on the logits' device (``seen``: in prompt or
    output; ``counts``: occurrences in output). Those tensors exist only when a penalty is set.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], grammar: GrammarState | None = None) -> None:
        self.params = params
        self.prompt_ids = tuple(prompt_ids)
        # No seed: draw one from the OS so runs differ; kept so that a run can be replayed.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.penalized = params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0
        self._pending: list[int] = []
        self._generator: torch.Generator | None = None
        self._position: torch.Tensor | None = None  # the generator's state after the last taken token's draw
        self._seen: torch.Tensor | None = None  # [V] bool
        self._counts: torch.Tensor | None = None  # [V] float32
        self.grammar = grammar  # constrained decoding (the params' json_schema / regex / ebnf, compiled)

    def append(self, token_id: int) -> None:
        """Record one generated token (O(1); penalty tensors catch up at the next ``sample``).

        A constrained request's grammar advances by the token (the mask allowed it).
        """
        if token_id < 0:
            raise ValueError(f"token id must be >= 0, got {token_id}")
        if self._generator is not None:  # its draw for this token is the one to go on from
            self._position = self._generator.get_state()
        if self.penalized:
            self._pending.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def fork(self) -> SamplingState:
        """A copy to try tokens on (speculative verification, ``spec_verify.py``): ``append`` on it leaves this
        state as it was. It shares this state's generator: draws from it go on from where they stand."""
        other = copy.copy(self)
        other._pending = list(self._pending)
        other._seen = None if self._seen is None else self._seen.clone()
        other._counts = None if self._counts is None else self._counts.clone()
        other.grammar = None if self.grammar is None else self.grammar.fork()
        return other

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for the next draw (created and seeded on ``device`` at first use), set back
        to where the last taken token's draw left it: a draw depends on the state alone."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(generator_seed(self.seed, device))
            self._position = self._generator.get_state()
        elif self._generator.device != device:
            raise ValueError(f"request sampled on {self._generator.device}, now given {device}")
        assert self._position is not None
        self._generator.set_state(self._position)
        return self._generator

    def penalty_tensors(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen [V] bool, counts [V] float32)`` including every appended token.

        Mutates: allocates the tensors at first call, then folds in the pending tokens.
        """
        if self._seen is None or self._counts is None:
            _check_ids(self.prompt_ids, vocab_size, "prompt")
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        elif self._seen.shape[0] != vocab_size or self._seen.device != device:
            raise ValueError(
                f"request's vocab/device was {self._seen.shape[0]} on {self._seen.device}, now {vocab_size} on {device}"
            )
        if self._pending:
            _check_ids(self._pending, vocab_size, "generated")
            ids = torch.tensor(self._pending, dtype=torch.long, device=device)
            self._counts.index_add_(0, ids, torch.ones(len(ids), device=device))  # repeats add up
            self._seen[ids] = True
            self._pending.clear()
        return self._seen, self._counts


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleOutput:
    """Choose one token per row of ``logits`` [B, V], row i under ``states[i]``.

    Does not modify ``logits`` and does not advance the states (call ``append`` with the
    tokens a request takes): the same states give the same tokens. Logprobs, when any state asks,
    are of the chosen token under the model's raw distribution, log_softmax of the
    unmodified logits (before penalties, temperature and filters): they describe the
    model, not the sampling settings (a greedy or top_k=1 row would otherwise always
    get 0). Rows whose params do not ask get None. ``top_logprobs`` ranks the same
    distribution. A constrained row picks only tokens its grammar allows.
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [batch, vocab] with vocab > 0, got {tuple(logits.shape)}")
    if logits.shape[0] != len(states):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(states)} states were given")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    raw = logits.float()
    penalized = penalize(raw, states)
    token_ids = penalized.argmax(dim=-1)  # the greedy rows' answer; one op for the batch
    rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if rows:
        token_ids[rows] = _sample_rows(penalized[rows], [states[i] for i in rows])
    logprobs, top = None, None
    if any(s.params.logprobs for s in states):
        log_probs = torch.log_softmax(raw, dim=-1)
        chosen = log_probs.gather(1, token_ids[:, None]).squeeze(1).tolist()
        logprobs = [lp if s.params.logprobs else None for lp, s in zip(chosen, states)]
        k = max(s.params.top_logprobs for s in states)
        if k:
            values, ids = log_probs.topk(min(k, log_probs.shape[1]), dim=-1)
            pairs = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
            top = [row[: s.params.top_logprobs] for row, s in zip(pairs, states)]
    return SampleOutput(token_ids.tolist(), logprobs, top)


def penalize(raw: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """``raw`` [B, V] float32 with each row's penalties and grammar mask applied (a new tensor if any apply)."""
    return apply_masks(_apply_penalties(raw, states), [s.grammar for s in states])


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition (CTRL) then frequency/presence (OpenAI) penalties; a new tensor if any apply."""
    rows = [i for i, s in enumerate(states) if s.penalized]
    if not rows:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    seen_list, counts_list = zip(*(states[i].penalty_tensors(vocab_size, device) for i in rows))
    seen, counts = torch.stack(seen_list), torch.stack(counts_list)
    params = [states[i].params for i in rows]
    rep = _column([p.repetition_penalty for p in params], device)
    freq = _column([p.frequency_penalty for p in params], device)
    pres = _column([p.presence_penalty for p in params], device)
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - (freq * counts + pres * (counts > 0))
    sub = sub.clamp(-_LOGIT_BOUND, _LOGIT_BOUND)  # an extreme penalty must not make inf (softmax -> NaN)
    out = logits.clone()
    out[rows] = sub
    return out


def _sample_rows(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then one draw per row from its own generator: [b] int64."""
    device = logits.device
    probs = filtered_probs(logits, states)
    # multinomial takes unnormalised weights; the max-probability token always survives.
    draws = [torch.multinomial(probs[i], 1, generator=s.generator(device)) for i, s in enumerate(states)]
    return torch.cat(draws)


def filtered_probs(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """[b, V]: each row's distribution after temperature, top_k, top_p and min_p (unnormalised where filtered:
    what a sampled row draws from)."""
    device = logits.device
    probs = torch.softmax(logits / _column([s.params.temperature for s in states], device), dim=-1)
    if any(s.params.top_k > 0 or s.params.top_p < 1 for s in states):
        probs = probs.masked_fill(~_top_k_top_p_keep(probs, states), 0.0)
    if any(s.params.min_p > 0 for s in states):
        floor = _column([s.params.min_p for s in states], device) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _top_k_top_p_keep(probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """[b, V] bool: tokens in the top k, then in the nucleus of that renormalised top k.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p: a token
    stays if the tokens ranked above it hold less than top_p. Rows with top_k == -1 and
    top_p == 1 get all True (an exact no-op, so their draws do not depend on the batch).
    """
    device, vocab_size = probs.device, probs.shape[1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    top_k = [min(s.params.top_k, vocab_size) if s.params.top_k > 0 else vocab_size for s in states]
    keep = torch.arange(vocab_size, device=device) < torch.tensor(top_k, device=device)[:, None]
    in_top_k = sorted_probs.masked_fill(~keep, 0.0)
    mass_before = in_top_k.cumsum(dim=-1) - in_top_k
    top_p = _column([s.params.top_p if s.params.top_p < 1 else math.inf for s in states], device)
    keep &= mass_before < top_p * in_top_k.sum(dim=-1, keepdim=True)
    keep[:, 0] = True  # the most likely token always stays (a tiny top_p underflows to an empty nucleus)
    return torch.zeros_like(keep).scatter(1, order, keep)


_LOGIT_BOUND = 1e4  # far beyond any real logit; keeps penalised rows finite


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        raise ValueError(f"{what} token ids must lie in [0, {vocab_size}), got {min(ids)}..{max(ids)}")
