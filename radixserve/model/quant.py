"""Weight-only int8: each linear's weight as int8 with one float scale per output channel.

Batch-1 decode reads every weight once per token, so 1-byte weights cut the
bytes a step reads ~4x against float32. Activations stay in the model dtype
and each row's result depends only on that row, so batch composition and
cache hits change nothing. Three matmuls, by what the machine offers:

- CPU, up to 16 rows (decode): our block kernel (csrc/block_linear.cpp, the int8 rows as Q8_0
  blocks of scale 1; csrc/int8_linear.cpp where in_features is not a multiple of 32);
- CPU, more rows (prefill): dequantize the weight once per call, then the dtype's GEMM;
- otherwise (no compiler, CUDA): torch's ``aten._weight_int8pack_mm``. Its CPU
  kernel is vectorised for AVX512 only: on AVX2 it ran ~10x slower than a
  float32 matmul at 1 row and ~25x at 16 (SmolLM2's shapes).

fbgemm's dynamic int8 linear is fast on AVX2 too, but it quantizes activations
per tensor: a token's output then depends on the other tokens of the batch,
and a cache hit changed greedy answers in our tests.

The embedding stays in the model dtype (a lookup reads one row per token); a
tied lm_head gets its own int8 copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import paged_kernel

QUANTIZATIONS = ("none", "int8", "q4_1", "q4_1-exact")  # q4_1: GGUF-style blocks, quant_blocks.py
# Q4_1/Q8_0 blocks (and a GGUF's Q4_0); q4_1 with int8 activations (as llama.cpp), q4_1-exact with float32 ones.
BLOCK_QUANTIZATIONS = ("q4_1", "q4_1-exact")
OWN_KERNEL_MAX_ROWS = 16  # decode-sized batches: our weight-reading kernel; more rows: dequantize + GEMM


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
        # The block kernel (csrc/block_linear.cpp) reads int8 rows as Q8_0 blocks whose scales are
        # all 1, then the channel's scale applies: it decodes a block once per 8 rows, where
        # int8_linear.cpp converts a row per x row (slower than float32 at 16 rows).
        self.unit_scales: torch.Tensor | None
        units = torch.ones(weight.shape[0], weight.shape[1] // 32, dtype=torch.float16, device=weight.device)
        self.register_buffer("unit_scales", units if weight.shape[1] % 32 == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, None)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x); in the block kernel (decode rows) scales and bias apply to each float32 sum, which
        is rounded to x's dtype, then the residual added and rounded again (as the GEMM path's residual + out)."""
        return self._forward(x, residual)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        kernel = x.device.type == "cpu" and paged_kernel.load()
        if kernel and x.shape[0] <= OWN_KERNEL_MAX_ROWS and self.unit_scales is not None:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            residual = None if residual is None else residual.contiguous()
            scales = self.scales.to(x.dtype)
            op = torch.ops.radixserve.block_linear
            # The residual after rounding, as the GEMM path (prefill) adds it: decode and prefill round alike.
            fused: torch.Tensor = op(x, self.weight_int8, self.unit_scales, None, bias, residual, scales, True)
            return fused
        out = self._matmul(x, kernel)
        out = out if self.bias is None else out + self.bias
        return out if residual is None else residual + out

    def _matmul(self, x: torch.Tensor, kernel: bool) -> torch.Tensor:
        if kernel:
            if x.shape[0] <= OWN_KERNEL_MAX_ROWS:  # in_features not a multiple of 32: no blocks
                out: torch.Tensor = torch.ops.radixserve.int8_linear(x, self.weight_int8, self.scales)
                return out
            # Many rows (prefill): dequantize once, then the dtype's own GEMM; the conversion is
            # amortised over the rows and each row's result still depends on that row alone.
            return F.linear(x, self.weight_int8.to(x.dtype) * self.scales[:, None])
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return out


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
