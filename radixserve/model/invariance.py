"""Split invariance: a token's logits do not depend on how many rows share its step.

A cache hit computes a prompt's uncached tail with fewer rows than a cold run; a chunk boundary or batch
companions change the row count too. The vendor GEMMs (oneDNN, MKL) pick their blocking by the row count, so a
row's bits moved with it, and in bfloat16 that changed 5-25% of greedy answers. Our block kernels compute each
(row, channel) with the same operations at any row count (float activations: block_linear.cpp; int8 activations:
block_q8_linear.cpp, with AVX512-VNNI at integer-GEMM speed; float weights: the GGUF float rows kernel over their
own bytes, gguf_rows_linear.cpp); the bfloat16 extend attention kernel reads keys in blocks aligned to absolute
positions, and elsewhere every extend reads in place through the paged kernel, whose sums run in position order
(attention.attention_split_invariance).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model import paged_kernel
from radixserve.model.gguf_rows import GGUFRows, GGUFRowsLinear
from radixserve.model.quant import Int8Linear
from radixserve.model.quant_blocks import BlockLinear

INVARIANT_KERNELS = ("vector", "amx")


def make_split_invariant(model: nn.Module, kernel: str = "vector") -> tuple[bool, str]:
    """Make every linear of ``model`` split-invariant (``invariant_kernel``: one kernel at any row count) when all
    of them can be, and say whether the model now is: (holds, why). A token's logits then do not depend on how many
    rows share its step, so a cache hit (or a chunk boundary, or batch companions) leaves every answer as a cold
    run gives it. Float linears (an HF checkpoint's, ``quantization="none"``) become GGUF float rows over their
    own bytes (gguf_rows.py: F32 / BF16 / F16, no copy), a tied lm_head too; int8 weights (``quantization=
    "int8"``) are not invariant: their GEMM's bits depend on the row count. ``kernel``: "vector" (the block
    decode kernel at every row count: decode at its speed; prefill slower than the vendor GEMM with float
    activations, at integer-GEMM speed with int8 ones on AVX512-VNNI) or "amx" (block_amx.cpp: bfloat16 rows on
    AMX tiles: prefill near the GEMM's speed, the block linears' decode ~2x slower; GGUF row types and int8
    activations keep their own kernel)."""
    if kernel == "amx" and not amx_available():
        raise ValueError("split_invariant_kernel amx needs a CPU (and kernel build) with AMX-BF16; use vector")
    others = [name for name, module in model.named_modules() if isinstance(module, Int8Linear)]
    floats = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    embedding = getattr(model, "embed_tokens", None)
    tied = getattr(model, "lm_head", False) is None and isinstance(embedding, nn.Embedding)
    if getattr(model, "lm_head", False) is None and not tied:
        return False, "not split-invariant: the tied lm_head runs torch's GEMM over a dequantized embedding"
    if others or not paged_kernel.load() or any(_float_rows(m.weight) is None for _, m in floats):
        # then the block linears keep their faster GEMM path: invariance would not hold anyway
        names = others or [name for name, _ in floats]
        return False, f"not split-invariant: {len(names)} linears run torch's GEMM (e.g. {names[0]})"
    for name, linear in floats:  # the float rows kernel over the same bytes: no copy
        parent, _, attr = name.rpartition(".")
        model.get_submodule(parent).__setattr__(attr, _as_rows(linear.weight, linear.bias))
    if tied and isinstance(embedding, nn.Embedding):  # logits = h @ embedding^T through the same kernel, its bytes
        model.lm_head = _as_rows(embedding.weight, None)
    kernels = [m for m in model.modules() if isinstance(m, BlockLinear | GGUFRowsLinear)]
    for module in kernels:
        module.invariant_kernel = kernel
    return True, f"split-invariant: every linear runs one kernel ({kernel}) at any row count"


# Float weights the GGUF rows kernel reads as they lie (csrc/gguf_rows_linear.cpp's F32 / BF16 / F16 rows).
FLOAT_ROW_TYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _float_rows(weight: torch.Tensor) -> GGUFRows | None:
    """``weight`` [N, K] as GGUF float rows over its own bytes (None where the kernel cannot read it)."""
    qtype = FLOAT_ROW_TYPES.get(weight.dtype)
    if qtype is None or weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
        return None
    return GGUFRows(weight.detach().view(torch.uint8).reshape(weight.shape[0], -1), qtype, weight.shape[1])


def _as_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> GGUFRowsLinear:
    rows = _float_rows(weight)
    assert rows is not None
    return GGUFRowsLinear(rows, bias, weight.dtype)


def amx_available() -> bool:
    """block_amx.cpp runs here: the kernel library built with AMX and the CPU and kernel grant the tile state."""
    return paged_kernel.load() and bool(torch.ops.radixserve.amx_available())
