"""A GGUF's matrices kept as the file stores them: which ones a model keeps (``usable_blocks``), as its linears and
embedding, and the account per GGUF type of what a load kept and what it converted, and why (quantization_detail,
/server_info's ``weights_by_type``).

A fused linear (q|k|v, gate|up) is kept when every part is. Parts of one kind (blocks of one width: Q4_0 with
Q4_1; rows of one type) concatenate into one weight; runs of different kinds (llama-quantize's Q4_K_M stores
SmolLM2's q and k as Q5_0 and v as Q8_0) are one ``PartsLinear``, each run its own linear::

    x [T, K] -> GGUFRowsLinear (q|k, Q5_0 rows)  -> [T, Nq + Nk] \\
             -> BlockLinear    (v, Q8_0 blocks)  -> [T, Nv]      / cat(-1) -> [T, Nq + Nk + Nv] = q|k|v
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import NamedTuple

import torch
from torch import nn

from radixserve.model.gguf_loader import Kept
from radixserve.model.gguf_rows import INT8_ROW_TYPES, GGUFRows, GGUFRowsEmbedding, GGUFRowsLinear, int8_rows_pay
from radixserve.model.precision import KEPT_TYPES
from radixserve.model.quant_blocks import BlockEmbedding, BlockLinear, QuantBlocks

# The GGUF types kept as their float values: they run float activations under every quantization.
FLOAT_TYPES = ("F16", "BF16", "F32")


# Each fused linear of a decoder layer and the HF weights it holds, rows in this order.
FUSED_PARTS = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o_proj"): ("self_attn.o_proj",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down_proj"): ("mlp.down_proj",),
}


def layer_parts(prefix: str, fused_checkpoint: bool) -> dict[tuple[str, str], tuple[str, ...]]:
    """(owner, attr) of each fused linear of a layer -> the HF weight names it holds, rows in order (phi3's
    checkpoints hold q|k|v and gate|up fused already, as one name each)."""
    return {
        (owner, attr): (f"{prefix}{owner}.{attr}.weight",)
        if fused_checkpoint
        else tuple(f"{prefix}{p}.weight" for p in parts)
        for (owner, attr), parts in FUSED_PARTS.items()
    }


def usable_blocks(blocks: Mapping[str, Kept], num_layers: int) -> dict[str, Kept]:
    """The part of ``blocks`` (HF name -> a file's own weights, ``GGUFFile.blocks``) that ``quantize("q4_1", blocks)``
    keeps as it is: a fused linear's parts only when every part is there (of any types: ``kept_linear``); the
    embedding and lm_head alone."""
    usable = {name: blocks[name] for name in ("model.embed_tokens.weight", "lm_head.weight") if name in blocks}
    for i in range(num_layers):
        for fused in (False, True):
            for names in layer_parts(f"model.layers.{i}.", fused).values():
                if all(name in blocks for name in names):
                    usable.update({name: blocks[name] for name in names})
    return usable


class PartsLinear(nn.Module):
    """Row-wise parts of one fused linear, each its own linear: x [T, K] -> their outputs side by side [T, N]."""

    def __init__(self, parts: Sequence[BlockLinear | GGUFRowsLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _kind(part: Kept) -> tuple[str, int | str]:
    """Parts of one kind concatenate: blocks of one width (``QuantBlocks.cat``), rows of one type."""
    return ("blocks", part.bits) if isinstance(part, QuantBlocks) else ("rows", part.qtype)


def _cat(parts: list[Kept]) -> Kept:
    if all(isinstance(p, QuantBlocks) for p in parts):
        return QuantBlocks.cat([p for p in parts if isinstance(p, QuantBlocks)])
    return GGUFRows.cat([p for p in parts if isinstance(p, GGUFRows)])


def linear_of(
    data: Kept, bias: torch.Tensor | None, dtype: torch.dtype, int8_activations: bool
) -> BlockLinear | GGUFRowsLinear:
    """The linear over one kept weight (float rows, F16 / BF16 / F32, run float activations whatever
    ``int8_activations``, and the rows with codes where their int8 kernel does not pay: ``runs_int8``)."""
    if isinstance(data, QuantBlocks):
        return BlockLinear(data, bias, dtype, int8_activations)
    return GGUFRowsLinear(data, bias, dtype, runs_int8(data.qtype, int8_activations))


def runs_int8(qtype: str, int8_activations: bool) -> bool:
    """Whether a kept weight of GGUF type ``qtype`` multiplies int8 activations in a model that asks for them: not
    the float types, and the rows with codes only where their int8 kernel pays (``gguf_rows.int8_rows_pay``)."""
    if not int8_activations or qtype in FLOAT_TYPES:
        return False
    return qtype not in INT8_ROW_TYPES or int8_rows_pay()


def embedding_of(data: Kept, dtype: torch.dtype) -> nn.Module:
    return BlockEmbedding(data, dtype) if isinstance(data, QuantBlocks) else GGUFRowsEmbedding(data, dtype)


def kept_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parts: Sequence[Kept | None],
    dtype: torch.dtype,
    int8_activations: bool = False,
) -> nn.Module | None:
    """The linear over the file's data for ``weight`` [N, K] (``parts``: its row-wise parts, in order) when every
    part was kept, else None (the caller converts ``weight``). ``bias`` is split across the runs of one kind."""
    found = [p for p in parts if p is not None]
    if not found or len(found) < len(parts):
        return None
    runs = [_cat(list(run)).to(weight.device) for _, run in groupby(found, key=_kind)]
    shapes = [run.shape for run in runs]
    if sum(n for n, _ in shapes) != weight.shape[0] or any(k != weight.shape[1] for _, k in shapes):
        raise ValueError(f"kept weights of shapes {shapes} for a weight of shape {tuple(weight.shape)}")
    biases = [None] * len(runs) if bias is None else list(torch.split(bias, [n for n, _ in shapes]))
    linears = [linear_of(run, b, dtype, int8_activations) for run, b in zip(runs, biases)]
    return linears[0] if len(linears) == 1 else PartsLinear(linears)


class Outcome(NamedTuple):
    """What became of one matrix: ``to`` "" (kept as the file stores it), or what it was converted to and why."""

    to: str = ""
    why: str = ""


def converted(qtype: str | None, to: str, lossless: bool) -> Outcome:
    """The outcome of a matrix stored as ``qtype`` (None: a float checkpoint) converted to ``to``: its type has no
    kernel, or a part of its fused linear was of such a type."""
    if qtype is not None and qtype in KEPT_TYPES:
        return Outcome(to, "its fused linear has a part of a type not kept")
    how = "dequantized (lossless)" if lossless else "re-quantized (lossy)"
    return Outcome(to, f"no kernel for {qtype or 'a float checkpoint'}: {how}")


@dataclass(frozen=True)
class TypeReport:
    """The matrices of one GGUF type: how many run as the file stores them, how many were converted, to what, why."""

    matrices: int
    kept: int
    converted: int
    converted_to: str  # "" when none was converted, else e.g. "float32" or "q4_1, q8_0"
    why: str
    activations: str = "float"  # what its kept matrices multiply: "float", or "int8" (blocks of 32, q4_1)


def weights_by_type(
    outcomes: Mapping[str, Outcome], types: Mapping[str, str], int8_activations: bool = False
) -> dict[str, TypeReport]:
    """GGUF type -> its TypeReport, over the matrices in ``outcomes`` whose type ``types`` names (HF name -> type).
    ``int8_activations``: the kept linears run int8 activations, except the float types' (F16, BF16, F32)."""
    by_type: dict[str, list[Outcome]] = {}
    for name, outcome in outcomes.items():
        if name in types:
            by_type.setdefault(types[name], []).append(outcome)
    return {
        qtype: TypeReport(
            len(found),
            sum(not o.to for o in found),
            sum(bool(o.to) for o in found),
            ", ".join(sorted({o.to for o in found if o.to})),
            "; ".join(sorted({o.why for o in found if o.why})),
            "int8" if runs_int8(qtype, int8_activations) else "float",
        )
        for qtype, found in sorted(by_type.items())
    }


def describe_by_type(table: Mapping[str, TypeReport]) -> str:
    """The quantization_detail's account: the file's weights kept per type (and the activations they multiply where
    int8), then those converted and why."""
    kept = ", ".join(
        f"{r.kept} {qtype}{' (int8 activations)' if r.activations == 'int8' else ''}"
        for qtype, r in table.items()
        if r.kept
    )
    text = f"; the file's blocks by type: {kept}" if kept else ""
    changed = [f"{r.converted} {qtype} to {r.converted_to} ({r.why})" for qtype, r in table.items() if r.converted]
    return text + (f"; converted: {', '.join(changed)}" if changed else "")
