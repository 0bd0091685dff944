"""Verify drafted tokens against one forward's logits: keep the longest prefix the sampler would have produced.

Row j of ``logits`` ([k + 1, V]) is the model's next-token distribution after the request's newest token and
drafts d1 .. dj. In order, each row gets the request's penalties and grammar mask as if d1 .. dj had been
taken (a forked sampling state advances through them; the request's own state is not touched), then:

    greedy:   d(j+1) is accepted when it is the row's argmax; the first that is not is replaced by the argmax
    sampled:  d(j+1) is accepted with probability p(d(j+1)) (p: the row's filtered distribution, what a plain
              step draws from); rejected, a token is drawn from p without d(j+1), renormalised
    after the last draft, if all were accepted, one more token from its row as a plain step would choose it

With a deterministic draft (q one-hot) this rule leaves each token distributed exactly as p: P(d) = p(d), and
for y != d, P(y) = (1 - p(d)) * p(y) / (1 - p(d)) = p(y) (speculative sampling with q = one-hot). Greedy rows
give the tokens a plain step gives from the same logits rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.core import SamplingParams, TopLogprobs
from radixserve.model.sampling import SampleOutput, SamplingState, filtered_probs, penalize


def verify(logits: torch.Tensor, drafts: Sequence[int], state: SamplingState) -> SampleOutput:
    """The tokens ``state``'s request takes from one verify step: the accepted drafts, then one chosen token.

    Draws (sampled rows) come from the request's generator, from the last taken token's position, as
    ``sample`` does. Logprobs as ``sample`` gives them: of the raw rows, per taken token.
    """
    if logits.dim() != 2 or logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} logits rows, got {tuple(logits.shape)}")
    raw = logits.float()
    if not torch.isfinite(raw).all():
        raise ValueError("the model produced non-finite logits (NaN or inf)")
    generator = None if state.params.greedy else state.generator(logits.device)  # before the fork: it shares it
    trial = state.fork()
    tokens: list[int] = []
    for j in range(len(drafts) + 1):
        draft = drafts[j] if j < len(drafts) else None
        token = _choose(penalize(raw[j : j + 1], [trial])[0], trial, draft, generator)
        tokens.append(token)
        if token != draft:
            break
        trial.append(token)
    return SampleOutput(tokens, *_logprobs(raw[: len(tokens)], tokens, state.params))


def _choose(row: torch.Tensor, state: SamplingState, draft: int | None, generator: torch.Generator | None) -> int:
    """``draft`` if it passes (greedy: it is the argmax; sampled: rejection sampling), else a token from the row."""
    if generator is None:
        return int(row.argmax())
    probs = filtered_probs(row[None], [state])[0]
    if draft is not None:
        accept = torch.rand(1, generator=generator, device=row.device)[0] * probs.sum() < probs[draft]
        if accept:
            return draft
        probs = probs.clone()
        probs[draft] = 0.0
        if not bool(probs.any()):  # p(draft) was all the mass (and u fell on its closed end)
            return draft
    return int(torch.multinomial(probs, 1, generator=generator))


def _logprobs(
    raw: torch.Tensor, tokens: list[int], params: SamplingParams
) -> tuple[list[float | None] | None, list[TopLogprobs] | None]:
    if not params.logprobs:
        return None, None
    log_probs = torch.log_softmax(raw, dim=-1)
    ids = torch.tensor(tokens, device=raw.device)
    chosen: list[float | None] = list(log_probs.gather(1, ids[:, None]).squeeze(1).tolist())
    if not params.top_logprobs:
        return chosen, None
    values, top_ids = log_probs.topk(min(params.top_logprobs, log_probs.shape[1]), dim=-1)
    return chosen, [list(zip(row_ids, row_values)) for row_ids, row_values in zip(top_ids.tolist(), values.tolist())]
