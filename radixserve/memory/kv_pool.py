"""The KV pool: per layer, K and V tensors of [num_kv_heads, num_slots, head_dim].

Slot i holds the K/V of whichever token the allocator handed it to; slot 0
(page 0) is padding. The pool knows nothing of requests: the model writes the
new tokens' K/V by slot index and reads a context by gathering its slots.

Heads first: gathering a context copies, per K/V head, contiguous head_dim rows
into the [heads, tokens, head_dim] blocks attention reads (measured on SmolLM2
at batch 32 decode: ~124 ms per step for gather + attention, vs ~200 ms with
slots first).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_kv_heads, num_slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token across all layers (SmolLM2 fp32: 30 x 3 x 64 x 2 x 4 B = 46 KiB)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, num_kv_heads, head_dim] of n tokens at ``slots`` [n]."""
        self.k[layer][:, slots] = k.transpose(0, 1).to(self.dtype)
        self.v[layer][:, slots] = v.transpose(0, 1).to(self.dtype)

    def write_rotated(
        self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> torch.Tensor:
        """The fused CPU path of attention's rotary + ``write``: qkv [n, (num_heads + 2 Hkv) * head_dim] (q | k | v
        of n tokens), cos/sin [n, 1, head_dim] in qkv's dtype. Rotates q and k, stores k and v at ``slots``
        [n] (int64) in one pass over the rows (csrc/fused_ops.cpp: the bits of apply_rotary + ``write``);
        returns q rotated, [n, num_heads, head_dim]. float32 or bfloat16 qkv and pool, on CPU."""
        q: torch.Tensor = torch.ops.radixserve.rotary_kv_write(
            qkv, cos, sin, slots, self.k[layer], self.v[layer], num_heads, self.k[layer].shape[0]
        )
        return q

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V [num_kv_heads, n, head_dim] of the tokens at ``slots`` [n] (a copy)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]
