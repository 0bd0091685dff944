"""Attention over the KV pool: QKV projection, rotary, K/V write, then attention per step.

Two backends. "paged" (CPU): a C++ kernel reads each request's K/V from the pool
in place (paged_kernel.py), for decode and short extends. "reference": gather
each context into a scratch buffer, then SDPA; the path tests compare against,
the path for long extends and the device-agnostic one. The masks and gather
indices depend only on the batch, so ``AttentionPlan`` builds them once per
forward and every layer reuses them::

    extend  request i:  q = its extend_lens[i] new rows     k/v = pool[context_slots[i]]
                        new token t (0-based) sees context 0 .. prefix_len + t
    decode  all:        q [B, H, 1, D]                       k/v = pool[padded slots] [B, Hkv, S_max, D]
                        mask [B, 1, 1, S_max]: True on each request's real context

Grouped-query attention goes through SDPA's ``enable_gqa``: K/V heads are never
repeated in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.memory.kv_pool import KVPool
from radixserve.model.config import ModelConfig
from radixserve.model.forward import ForwardBatch
from radixserve.model.gather import GatherWorkspace, grouped_matmul_attention
from radixserve.model.layers import apply_rotary
from radixserve.model.paged_kernel import PagedIndex, paged_attention


@dataclass(frozen=True)
class ExtendSpan:
    """One request in an extend step: its rows in the flattened batch and its context."""

    start: int
    end: int
    context_slots: torch.Tensor  # [ctx_len]
    mask: torch.Tensor | None  # [extend_len, ctx_len] bool; None for a cold prefill (plain causal)


# A request extending by more rows than this goes through gather + SDPA: the copy of its
# context is amortised over its rows, and SDPA's blocked kernel beats the paged kernel's
# per-row loops there. Decode and short extends (speculative, mixed-in) read in place.
PAGED_MAX_EXTEND_LEN = 8


@dataclass(frozen=True)
class AttentionPlan:
    """Per-step indices and masks, shared by every layer.

    ``paged`` set: every request reads the pool in place through the kernel. Otherwise the
    reference path: extend per request (``spans``), decode padded to the longest context.
    """

    mode: str
    workspace: GatherWorkspace
    spans: list[ExtendSpan]  # extend only
    padded_slots: torch.Tensor | None  # decode: [B, S_max]; padding points at slot 0
    decode_mask: torch.Tensor | None  # decode: [B, 1, 1, S_max] bool; None when all lengths are equal
    paged: PagedIndex | None = None

    @classmethod
    def build(cls, batch: ForwardBatch, workspace: GatherWorkspace, backend: str = "reference") -> AttentionPlan:
        """``backend``: "paged" (in place, where the step suits it) or "reference" (gather + SDPA)."""
        if backend == "paged" and max(batch.extend_lens, default=0) <= PAGED_MAX_EXTEND_LEN:
            return cls(batch.mode, workspace, [], None, None, PagedIndex.build(batch.context_slots, batch.extend_lens))
        if batch.mode == "decode":
            return cls._build_decode(batch, workspace)
        spans, start = [], 0
        for slots, extend_len in zip(batch.context_slots, batch.extend_lens):
            prefix_len = slots.shape[0] - extend_len
            mask = None
            if prefix_len > 0:  # causal, shifted right by the cached prefix
                device = slots.device
                cols = torch.arange(slots.shape[0], device=device)
                rows = torch.arange(extend_len, device=device) + prefix_len
                mask = cols[None, :] <= rows[:, None]
            spans.append(ExtendSpan(start, start + extend_len, slots, mask))
            start += extend_len
        return cls("extend", workspace, spans, None, None)

    @classmethod
    def _build_decode(cls, batch: ForwardBatch, workspace: GatherWorkspace) -> AttentionPlan:
        lens = [slots.shape[0] for slots in batch.context_slots]
        padded = nn.utils.rnn.pad_sequence(batch.context_slots, batch_first=True, padding_value=0)
        mask = None
        if min(lens) != max(lens):
            device = padded.device
            lens_t = torch.tensor(lens, device=device)
            mask = (torch.arange(max(lens), device=device)[None, :] < lens_t[:, None])[:, None, None, :]
        return cls("decode", workspace, [], padded, mask)


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads, reading and writing the KV pool."""

    def __init__(self, config: ModelConfig, layer_id: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        # Qwen2 has a bias on q, k, v only; Llama's attention_bias also covers o_proj.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=config.attention_bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias, device=device, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the new tokens' K/V at ``out_slots`` first."""
        q, k, v = torch.split(self.qkv_proj(x), self.split_sizes, dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        kv_pool.write(self.layer_id, out_slots, k, v.view(-1, self.num_kv_heads, self.head_dim))
        if plan.paged is not None:
            out = paged_attention(q, kv_pool.k[self.layer_id], kv_pool.v[self.layer_id], plan.paged)
        elif plan.mode == "decode":
            out = self._decode(q, plan, kv_pool)
        else:
            spans = plan.spans
            out = torch.cat([self._extend_one(q[s.start : s.end], s, plan.workspace, kv_pool) for s in spans])
        result: torch.Tensor = self.o_proj(out.reshape(x.shape[0], -1))
        return result

    def _extend_one(
        self, q: torch.Tensor, span: ExtendSpan, workspace: GatherWorkspace, kv_pool: KVPool
    ) -> torch.Tensor:
        """One request: q [L, H, D] against its context [Hkv, S, D] -> [L, H, D]."""
        k, v = workspace.gather(kv_pool, self.layer_id, span.context_slots)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.to(q.dtype)[None],
            v.to(q.dtype)[None],
            attn_mask=span.mask,
            is_causal=span.mask is None,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, plan: AttentionPlan, kv_pool: KVPool) -> torch.Tensor:
        """All requests at once: q [B, H, D] against padded contexts [B, Hkv, S_max, D] -> [B, H, D]."""
        assert plan.padded_slots is not None
        k, v = plan.workspace.gather(kv_pool, self.layer_id, plan.padded_slots)
        k, v = k.to(q.dtype), v.to(q.dtype)  # the pool may store another dtype
        if q.dtype == torch.bfloat16 and q.device.type == "cpu":
            return grouped_matmul_attention(q, k, v, plan.decode_mask)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=plan.decode_mask, enable_gqa=True)
        return out[:, :, 0, :]
