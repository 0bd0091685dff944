"""ModelRunner: turns host-side slot lists into a ForwardBatch and runs one model step.

It owns the model and the KV pool and knows nothing of requests or caches:
callers hand it, per request, the new tokens and the slots of the whole
context (cached prefix first), and get back each request's last-token logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model.config import ModelConfig
from radixserve.model.forward import ForwardBatch, ForwardMode


class CausalLM(Protocol):
    def __call__(
        self, batch: ForwardBatch, kv_pool: KVPool, return_all_logits: bool = False, return_hidden: bool = False
    ) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepInput:
    """One request's part of a step: its new tokens and its whole context's slots."""

    new_token_ids: Sequence[int] | np.ndarray
    context_slots: np.ndarray  # int64: prefix slots, then one slot per new token
    num_draft_tokens: int = 0  # a decode verifying drafts: its last this many new tokens are drafts


class ModelRunner:
    def __init__(self, model: CausalLM, config: ModelConfig, kv_pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.kv_pool = kv_pool
        self.device = device

    @torch.inference_mode()
    def forward(
        self,
        inputs: list[StepInput],
        mode: ForwardMode,
        all_logits: bool = False,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits [len(inputs), vocab] (float32) of each request's last new token; ``all_logits``: of every
        new token, [sum of new tokens, vocab] (prompt logprobs); ``logit_rows``: of request i's last
        ``logit_rows[i]`` new tokens, concatenated (prompt logprobs, draft verification)."""
        if logit_rows is not None:
            return self.forward_hidden(inputs, mode, logit_rows=logit_rows)[0]
        batch = self.build_batch(inputs, mode)
        return self.model(batch, self.kv_pool, return_all_logits=all_logits).float()

    @torch.inference_mode()
    def forward_hidden(
        self,
        inputs: list[StepInput],
        mode: ForwardMode,
        all_logits: bool = False,
        logit_rows: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the same rows' final hidden states (float32) from one forward:
        what an embedding request reads."""
        batch = self.build_batch(inputs, mode)
        every = all_logits or logit_rows is not None
        hidden = self.model(batch, self.kv_pool, return_all_logits=every, return_hidden=True)
        if logit_rows is not None:  # the final norm is per row: the same bits as the model's own last rows
            ends = np.cumsum([len(item.new_token_ids) for item in inputs])
            keep = np.concatenate([np.arange(end - n, end) for end, n in zip(ends, logit_rows)])
            hidden = hidden[torch.from_numpy(keep).to(hidden.device)]
        return self.model.logits(hidden), hidden.float()

    def build_batch(self, inputs: list[StepInput], mode: ForwardMode) -> ForwardBatch:
        """``mode`` mixed: prefill chunks next to decodes (one new token each) in one forward."""
        if mode not in ("extend", "decode", "mixed"):
            raise ValueError(f"unknown forward mode {mode!r}")  # callers outside the type checker
        ids, positions, out_slots, contexts, lens = [], [], [], [], []
        rows, solo = _decode_rows(inputs)
        for item in rows:
            new = np.asarray(item.new_token_ids, dtype=np.int64)
            ctx = np.asarray(item.context_slots, dtype=np.int64)
            if not 0 < len(new) <= len(ctx) or (mode == "decode" and len(new) != 1):
                raise ValueError(f"{mode}: {len(new)} new tokens for a context of {len(ctx)}")
            prefix_len = len(ctx) - len(new)
            ids.append(new)
            positions.append(np.arange(prefix_len, len(ctx), dtype=np.int64))
            out_slots.append(ctx[prefix_len:])
            contexts.append(torch.from_numpy(ctx).to(self.device))
            lens.append(len(new))
        return ForwardBatch(
            mode,
            self._to_device(ids),
            self._to_device(positions),
            self._to_device(out_slots),
            contexts,
            lens,
            solo,
        )

    def _to_device(self, parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts)).to(self.device)


def _decode_rows(inputs: list[StepInput]) -> tuple[list[StepInput], list[bool]]:
    """``inputs`` with each decode verifying drafts split into one-token decodes, one per new token, each on
    the context up to itself, and which rows those are (empty: none). Every row is computed as a plain decode
    computes it (the same kernels, the same bits: an extend's rows may differ in the last bits), read alone (the
    rows share their whole context, and a shared-prefix group's merge rounds differently); their logits rows
    stay in the same order. Row j reads the K/V the rows before it wrote in the same layer, as an extend's do."""
    if not any(item.num_draft_tokens for item in inputs):
        return inputs, []
    rows, solo = [], []
    for item in inputs:
        if not item.num_draft_tokens:
            rows.append(item)
            solo.append(False)
            continue
        new = np.asarray(item.new_token_ids, dtype=np.int64)
        prefix_len = len(item.context_slots) - len(new)
        rows += [StepInput(new[j : j + 1], item.context_slots[: prefix_len + j + 1]) for j in range(len(new))]
        solo += [True] * len(new)
    return rows, solo
