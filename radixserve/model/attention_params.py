"""What one layer's attention computes beyond softmax(q k^T / sqrt(head_dim)) v over its causal context.

Three per-layer options, the same in every attention path (the C++ paged, extend and shared-prefix
kernels, gather + SDPA, the bf16 decode matmuls); Gemma alternates local (windowed) and global layers::

    window   0: none. W > 0: the query at context position p sees keys max(0, p - W + 1) .. p, W keys at most
             (transformers' sliding_window_overlay: kv_idx > q_idx - W, on top of the causal kv_idx <= q_idx)
    softcap  0.0: none. c > 0: scores = c * tanh(scores / c), after the scale, before the softmax (Gemma 2)
    scale    None: head_dim ** -0.5, as each path computed it before these options existed (SDPA its own
             default), so a layer with no option set gets exactly those bits; Gemma: query_pre_attn_scalar ** -0.5

Positions are context indices: a request's context is its whole sequence, slot 0 holding token 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionParams:
    """One layer's window, soft cap and scale (see the module docstring); the defaults are plain attention."""

    window: int = 0
    softcap: float = 0.0
    scale: float | None = None

    def __post_init__(self) -> None:
        if self.window < 0 or self.softcap < 0 or (self.scale is not None and not self.scale > 0):
            raise ValueError(f"attention: window and softcap must be >= 0 (0: none), scale > 0; got {self}")

    def kernel_scale(self, head_dim: int) -> float:
        """The scale the kernels multiply by (their default, head_dim ** -0.5, when none is set)."""
        return head_dim**-0.5 if self.scale is None else self.scale

    def first_key(self, ctx_len: int, extend_len: int) -> int:
        """The first context key any of a request's new tokens sees: its first new token's window start."""
        return max(0, ctx_len - extend_len + 1 - self.window) if self.window else 0

    def mask(self, positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[len(positions), len(key_positions)] bool: which keys each query sees (causal, and the window)."""
        delta = positions[:, None] - key_positions[None, :]
        visible = delta >= 0
        return visible & (delta < self.window) if self.window else visible

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """The soft cap on already scaled scores (none: ``scores`` itself)."""
        return torch.tanh(scores / self.softcap) * self.softcap if self.softcap else scores


DEFAULT_PARAMS = AttentionParams()
