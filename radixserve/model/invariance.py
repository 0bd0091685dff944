"""Split invariance: a token's logits do not depend on how many rows share its step.

A cache hit computes a prompt's uncached tail with fewer rows than a cold run; a chunk boundary or batch
companions change the row count too. The vendor GEMMs (oneDNN, MKL) pick their blocking by the row count, so a
row's bits moved with it, and in bfloat16 that changed 5-25% of greedy answers. Our block kernels compute each
(row, channel) with the same operations at any row count (float activations: block_linear.cpp; int8 activations:
block_q8_linear.cpp, with AVX512-VNNI at integer-GEMM speed); the bfloat16 extend attention kernel reads keys in
blocks aligned to absolute positions (attention.attention_split_invariance).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model import paged_kernel
from radixserve.model.gguf_rows import GGUFRowsLinear
from radixserve.model.quant import Int8Linear
from radixserve.model.quant_blocks import BlockLinear

INVARIANT_KERNELS = ("vector", "amx")


def make_split_invariant(model: nn.Module, kernel: str = "vector") -> tuple[bool, str]:
    """Make every block linear of ``model`` split-invariant (``invariant_kernel``: one kernel at any row
    count) when all its linears can be, and say whether the model now is: (holds, why). A token's logits then do
    not depend on how many rows share its step, so a cache hit (or a chunk boundary, or batch companions) leaves
    every answer as a cold run gives it. Float linears (torch's GEMM) and int8 weights are not invariant: their
    GEMMs' bits depend on the row count. ``kernel``: "vector" (the block decode kernel at every row count: decode
    at its speed; prefill slower than the vendor GEMM with float activations, at integer-GEMM speed with int8 ones
    on AVX512-VNNI) or "amx" (block_amx.cpp: bfloat16 rows on AMX tiles: prefill near the GEMM's speed, the block
    linears' decode ~2x slower; GGUF row types and int8 activations keep their own kernel)."""
    kernels: list[BlockLinear | GGUFRowsLinear] = []
    others = []
    for name, module in model.named_modules():
        if isinstance(module, BlockLinear | GGUFRowsLinear):
            kernels.append(module)
        elif isinstance(module, BlockLinear | nn.Linear | Int8Linear):
            others.append(name)
    if others:  # then the block linears keep their faster GEMM path: invariance would not hold anyway
        return False, f"not split-invariant: {len(others)} linears run torch's GEMM (e.g. {others[0]})"
    if kernel == "amx" and not amx_available():
        raise ValueError("split_invariant_kernel amx needs a CPU (and kernel build) with AMX-BF16; use vector")
    for module in kernels:
        module.invariant_kernel = kernel
    return True, f"split-invariant: every linear runs one kernel ({kernel}) at any row count"


def amx_available() -> bool:
    """block_amx.cpp runs here: the kernel library built with AMX and the CPU and kernel grant the tile state."""
    return paged_kernel.load() and bool(torch.ops.radixserve.amx_available())
