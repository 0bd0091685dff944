"""The reference attention path: gather each request's context out of the pool, then SDPA.

It copies every request's whole context per layer per step, which the paged
kernel (paged_kernel.py) avoids; it stays as the path tests compare against,
the path for long extends (the copy is amortised over many query rows) and
the device-agnostic path (CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.memory.kv_pool import KVPool
from radixserve.model.attention_params import DEFAULT_PARAMS, AttentionParams


class GatherWorkspace:
    """Heads-first scratch buffers that every layer's K/V gather reuses, within and across steps.

    Why not ``kv_pool.read``: (1) a fresh multi-MB tensor per gather costs page
    faults on CPU (glibc hands large freed blocks back to the kernel), which made
    gathers of a batch-8 decode step ~5x dearer; (2) advanced indexing gathers
    rows several times slower than index_select; (3) SDPA reads a context ~1.7x
    faster when each (request, head) block is contiguous, so each K/V head is
    gathered into its own block. Results are valid until the next gather, which
    is enough since each layer finishes its attention first. One step at a time.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def gather(self, kv_pool: KVPool, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [*slots.shape[:-1], Hkv, S, D] of the tokens at ``slots`` [..., S] (views into the buffers; an
        8-bit pool's dequantized to float32, a fresh copy: this is the reference path)."""
        if kv_pool.quantized:
            k, v = kv_pool.dequantized(layer_id, slots, torch.float32)
            return k.movedim(0, -3), v.movedim(0, -3)
        k_pool, v_pool = kv_pool.k[layer_id], kv_pool.v[layer_id]
        self._k = _ensure_rows(self._k, k_pool, slots.numel())
        self._v = _ensure_rows(self._v, v_pool, slots.numel())
        return _gather_heads_first(self._k, k_pool, slots), _gather_heads_first(self._v, v_pool, slots)


def _ensure_rows(buffer: torch.Tensor | None, pool: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``buffer`` [Hkv, >= num_rows, D] matching ``pool`` [Hkv, N, D]; reallocated (doubling) when short."""
    num_heads, head_dim = pool.shape[0], pool.shape[2]
    if (
        buffer is not None
        and buffer.shape[1] >= num_rows
        and buffer.shape[::2] == (num_heads, head_dim)
        and buffer.dtype == pool.dtype
        and buffer.device == pool.device
    ):
        return buffer
    # Doubling: decode contexts grow by one token a step; do not reallocate every step.
    size = max(num_rows, 2 * buffer.shape[1] if buffer is not None else 0)
    return pool.new_empty((num_heads, size, head_dim))


def _gather_heads_first(buffer: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool [Hkv, N, D] rows at slots [..., S] -> [..., Hkv, S, D], written into ``buffer``."""
    flat = slots.reshape(-1)
    for head in range(pool.shape[0]):
        torch.index_select(pool[head], 0, flat, out=buffer[head, : flat.shape[0]])
    num_heads, head_dim = pool.shape[0], pool.shape[2]
    return buffer[:, : flat.shape[0]].view(num_heads, *slots.shape, head_dim).movedim(0, -3)


def grouped_matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    params: AttentionParams = DEFAULT_PARAMS,
) -> torch.Tensor:
    """Decode attention as two batched matmuls, for bf16 on CPU where SDPA is many times slower, and for
    a soft cap, which SDPA lacks.

    q [B, H, D], k/v [B, Hkv, S, D] -> [B, H, D]. The query heads sharing a K/V
    head are stacked as rows, so K/V are never repeated; softmax in float32.
    ``mask`` [B, 1, 1, S] (the window included): True on the keys each row sees.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * params.kernel_scale(head_dim)  # [B, Hkv, G, S]
    scores = params.cap(scores)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)


def extend_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, params: AttentionParams
) -> torch.Tensor:
    """One request's rows: q [L, H, D] against its context k/v [Hkv, S, D] -> [L, H, D].

    ``mask`` [L, S] (the window included), None for plain causal (a cold prefill). SDPA, with the layer's
    scale; with a soft cap, which SDPA lacks, the same steps by hand (query heads of a K/V head stacked
    as rows, softmax in float32)."""
    if not params.softcap:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.to(q.dtype)[None],
            v.to(q.dtype)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
            scale=params.scale,
        )
        return out[0].transpose(0, 1)
    extend_len, num_heads, head_dim = q.shape
    num_kv_heads, ctx_len = k.shape[:2]
    if mask is None:
        mask = torch.ones(extend_len, ctx_len, dtype=torch.bool, device=q.device).tril(ctx_len - extend_len)
    rows = q.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)  # [Hkv, G * L, D]: heads h = hkv * G + g
    scores = torch.matmul(rows, k.to(q.dtype).transpose(-1, -2)).float() * params.kernel_scale(head_dim)
    scores = params.cap(scores).view(num_kv_heads, -1, extend_len, ctx_len).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype).view(num_kv_heads, -1, ctx_len)
    return torch.matmul(probs, v.to(q.dtype)).view(num_heads, extend_len, head_dim).transpose(0, 1)
