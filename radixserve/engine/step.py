"""The engine step: one scheduled batch through the model, then a token sampled for each entry that samples.

``StepExecutor.run(batch)`` returns one ``StepOutput`` per entry (tokens and
logprobs) and changes no request, its sampling state included: ``Scheduler.process``
applies the outputs, through the output stage (``output.py``: text, stop strings).
A request that breaks the step fails alone, the others go on: a failed forward is
retried one request at a time, a row of NaN/inf logits or a sampling error becomes
that request's ``error``. A "verify" entry (a decode with drafts) gets the logits of its newest token
and every draft from the same forward; ``spec_verify.verify`` says which tokens it takes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from radixserve.model.runner import ModelRunner, StepInput
from radixserve.model.sampling import sample
from radixserve.model.spec_verify import verify
from radixserve.scheduler.batch import BatchMode, ScheduledBatch, ScheduledRequest, StepOutput

logger = logging.getLogger(__name__)

NON_FINITE = "the model produced non-finite logits (NaN or inf)"


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of ``logits`` [rows, vocab] is all finite. A row's max and min are finite exactly when every
    entry is (max and min propagate NaN; an inf is one of them): two reductions instead of a bool copy of the whole
    tensor and its ``all`` (22 against 134 us a decode step for SmolLM2's 49,152 logits, ~1% of the step)."""
    extremes = torch.stack((logits.amax(dim=-1), logits.amin(dim=-1)))
    finite: list[bool] = torch.isfinite(extremes).all(dim=0).tolist()
    return finite


PromptLogprobs = tuple[tuple[int, float], ...]


class StepExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, batch: ScheduledBatch) -> list[StepOutput]:
        """One forward over ``batch``, then a token for each entry that samples."""
        entries = batch.entries
        if not entries:
            return []
        errors: dict[int, str] = {}  # entry index -> why it failed
        scored: dict[int, PromptLogprobs] = {}  # entry index -> the prompt logprobs its chunk scored
        scored_hidden: dict[int, np.ndarray] = {}  # entry index -> its last token's hidden state (embeddings)
        drafted: dict[int, torch.Tensor] = {}  # entry index -> a verify entry's logits, one row per new token
        rows, logits = self._forward(entries, batch.mode, errors, _Scored(scored, scored_hidden, drafted))
        sampled: dict[int, StepOutput] = {}
        if logits is not None:
            finite = finite_rows(logits)
            for row, i in enumerate(rows):
                if not finite[row]:
                    errors[i] = NON_FINITE
            wanted = [(row, i) for row, i in enumerate(rows) if i not in errors and entries[i].sample]
            sampled = self._sample(logits, entries, [(row, i) for row, i in wanted if i not in drafted], errors)
            sampled.update(self._verify(entries, drafted, [i for _, i in wanted if i in drafted], errors))
        computed = set(rows)
        outputs = []
        for i in range(len(entries)):
            out = sampled[i] if i in sampled else StepOutput(computed=i in computed, error=errors.get(i))
            out = dataclasses.replace(out, prompt_logprobs=scored[i]) if i in scored else out
            outputs.append(dataclasses.replace(out, hidden=scored_hidden[i]) if i in scored_hidden else out)
        return outputs

    def _forward(
        self,
        entries: Sequence[ScheduledRequest],
        mode: BatchMode,
        errors: dict[int, str],
        scored: _Scored,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Logits (one row per entry that ran) and which entries they belong to.

        If the batched call fails, each request runs alone; the failing ones get an error.
        """
        try:
            return list(range(len(entries))), self._model(entries, mode, scored, list(range(len(entries))))
        except Exception as exc:
            if len(entries) == 1:
                logger.exception("model step failed for request %d", entries[0].req.rid)
                errors[0] = _message(exc)
                return [], None
            logger.warning("a %d-request %s step failed (%s); retrying each request alone", len(entries), mode, exc)
        rows: list[int] = []
        logits = []
        for i, entry in enumerate(entries):
            try:
                logits.append(self._model([entry], ScheduledBatch((entry,)).mode, scored, [i]))
                rows.append(i)
            except Exception as exc:
                logger.exception("model step failed for request %d", entry.req.rid)
                errors[i] = _message(exc)
        return rows, (torch.cat(logits) if logits else None)

    def _model(
        self, entries: Sequence[ScheduledRequest], mode: BatchMode, scored: _Scored, at: list[int]
    ) -> torch.Tensor:
        """Each entry's last-token logits; entries scoring their prompt put its logprobs in ``scored.logprobs[at[k]]``,
        entries that want their hidden state (embeddings) put it in ``scored.hidden[at[k]]``.

        Only a batch with such an entry asks the model for every position's logits, or for hidden states.
        """
        inputs = [_step_input(e) for e in entries]
        every_row = [_scores_prompt(e) or e.mode == "verify" for e in entries]
        counts = [len(e.new_token_ids) if every else 1 for e, every in zip(entries, every_row)]
        many = counts if any(every_row) else None  # logits rows per entry (None: its last row each)
        hidden = None
        if any(_wants_hidden(e) for e in entries):
            logits, hidden = self.runner.forward_hidden(inputs, mode, logit_rows=many)
        elif many:
            logits = self.runner.forward(inputs, mode, logit_rows=many)
        else:
            return self.runner.forward(inputs, mode)
        if many:
            ends = np.cumsum(counts)
            for k, entry in enumerate(entries):
                block = logits[ends[k] - counts[k] : ends[k]]
                if _scores_prompt(entry):
                    scored.logprobs[at[k]] = prompt_logprobs(entry, block)
                if entry.mode == "verify":
                    scored.drafted[at[k]] = block
            last = torch.as_tensor(ends - 1, device=logits.device)
            logits, hidden = logits[last], None if hidden is None else hidden[last]
        for k, entry in enumerate(entries):
            if hidden is not None and _wants_hidden(entry):
                scored.hidden[at[k]] = hidden[k].cpu().numpy()
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        entries: Sequence[ScheduledRequest],
        wanted: list[tuple[int, int]],
        errors: dict[int, str],
    ) -> dict[int, StepOutput]:
        """Entry index -> its token; if batched sampling fails, row by row."""
        if not wanted:
            return {}
        reqs = [entries[i].req for _, i in wanted]
        try:
            out = sample(logits[[row for row, _ in wanted]], [req.sampling for req in reqs])
            return {
                i: StepOutput(
                    out.token_ids[k],
                    out.logprobs[k] if out.logprobs else None,
                    out.top_logprobs[k] if out.top_logprobs else None,
                )
                for k, (_, i) in enumerate(wanted)
            }
        except Exception as exc:
            logger.warning("sampling a batch of %d failed (%s); sampling each request alone", len(reqs), exc)
        outputs = {}
        for req, (row, i) in zip(reqs, wanted):
            try:
                one = sample(logits[row : row + 1], [req.sampling])
            except Exception as exc:
                logger.exception("sampling failed for request %d", req.rid)
                errors[i] = _message(exc)
                continue
            top = one.top_logprobs[0] if one.top_logprobs else None
            outputs[i] = StepOutput(one.token_ids[0], one.logprobs[0] if one.logprobs else None, top)
        return outputs

    def _verify(
        self,
        entries: Sequence[ScheduledRequest],
        drafted: dict[int, torch.Tensor],
        wanted: list[int],
        errors: dict[int, str],
    ) -> dict[int, StepOutput]:
        """Entry index -> the tokens a verify entry takes (``token``, then ``more``)."""
        outputs = {}
        for i in wanted:
            entry = entries[i]
            drafts = entry.new_token_ids[len(entry.new_token_ids) - entry.num_draft_tokens :].tolist()
            try:
                out = verify(drafted[i], drafts, entry.req.sampling)
            except Exception as exc:
                logger.exception("verifying drafts failed for request %d", entry.req.rid)
                errors[i] = _message(exc)
                continue
            steps = [
                StepOutput(
                    token,
                    out.logprobs[k] if out.logprobs else None,
                    out.top_logprobs[k] if out.top_logprobs else None,
                )
                for k, token in enumerate(out.token_ids)
            ]
            outputs[i] = dataclasses.replace(steps[0], more=tuple(steps[1:]))
        return outputs


class _Scored(NamedTuple):
    """What a forward reads out besides the logits, by entry index."""

    logprobs: dict[int, PromptLogprobs]  # the prompt logprobs a chunk scored
    hidden: dict[int, np.ndarray]  # the last prompt token's final hidden state (an embedding request)
    drafted: dict[int, torch.Tensor]  # a verify entry's logits: its newest token's row, then each draft's


def _wants_hidden(entry: ScheduledRequest) -> bool:
    """An embedding request's last prompt chunk: its last token's hidden state is the embedding."""
    return entry.req.return_hidden and entry.sample and not entry.req.output_ids


def _scores_prompt(entry: ScheduledRequest) -> bool:
    return entry.mode == "extend" and entry.req.input_logprobs is not None


def prompt_logprobs(entry: ScheduledRequest, logits: torch.Tensor) -> PromptLogprobs:
    """(position p, log P(prompt[p] | prompt[:p])) for the prompt positions this chunk's logits score.

    Row k is the logits at position ``chunk_start + k``: it scores the token after it. Positions
    from ``logprob_start_len + 1`` to the prompt's end are scored (the start itself has no score).
    """
    req = entry.req
    chunk_start = len(entry.context_slots) - len(entry.new_token_ids)
    first = max(chunk_start, req.logprob_start_len)  # the first position whose next token is scored
    last = min(chunk_start + len(entry.new_token_ids), len(req.prompt_ids) - 1)  # exclusive
    if first >= last:
        return ()
    targets = torch.as_tensor(req.prompt_ids[first + 1 : last + 1], device=logits.device)
    rows = torch.log_softmax(logits[first - chunk_start : last - chunk_start].float(), dim=-1)
    values = rows.gather(1, targets[:, None]).squeeze(1).tolist()
    return tuple(zip(range(first + 1, last + 1), values))


def _step_input(entry: ScheduledRequest) -> StepInput:
    return StepInput(entry.new_token_ids, entry.context_slots, entry.num_draft_tokens)


def _message(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
