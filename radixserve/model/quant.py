"""Weight-only int8: each linear's weight as int8 with one float scale per output channel.

Batch-1 decode reads every weight once per token, so 1-byte weights cut the
bytes a step reads ~4x against float32. The matmul is torch's own
``aten._weight_int8pack_mm``: activations stay in the model dtype and each
row's result depends only on that row, so batch composition and cache hits
change nothing. Its CPU kernel is vectorised for AVX512; on AVX2 it runs
slower than a float32 matmul (measured: SmolLM2's shapes ~10x), so there int8
buys memory, not speed. fbgemm's dynamic int8 linear is faster on AVX2 but it
quantizes activations per tensor: a token's output then depends on the other
tokens in the batch, and a cache hit changed greedy answers in our tests.

The embedding stays in the model dtype (a lookup reads one row per token); a
tied lm_head gets its own int8 copy.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scales [N]): symmetric, max |w| of a row maps to 127."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class Int8Linear(nn.Module):
    """A drop-in for ``nn.Linear`` (x [T, K] -> [T, N]) holding int8 weights and per-channel scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        q, scales = quantize_per_channel(weight)
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.weight_int8: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return out if self.bias is None else out + self.bias


def quantize_linears(root: nn.Module, names: tuple[str, ...], dtype: torch.dtype) -> None:
    """Replace every ``nn.Linear`` child of ``root``'s modules called one of ``names`` by an Int8Linear."""
    for module in list(root.modules()):
        for name in names:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight.detach(), child.bias, dtype))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters and buffers (int8 weights and their scales)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
