"""Attention over the KV pool: QKV projection, rotary, K/V write, then attention per step.

Two backends. "paged" (CPU): a C++ kernel reads each request's K/V from the pool
in place (paged_kernel.py), for decode and short extends; requests whose contexts
start with the same slots (a radix hit) read that shared prefix once per step
(cascade attention, shared_prefix.py). Where q and the pool are bfloat16 on a CPU
with AVX512-BF16, every extend (prefill chunks, a cache hit's tail) goes to the
extend kernel instead (flash attention on bf16 dot products, csrc/extend_attention.h).
"reference": gather each context into a scratch buffer, then SDPA; the path tests
compare against, the path for long extends elsewhere and the device-agnostic one.
The masks and gather indices depend only on the batch, so ``AttentionPlan`` builds
them once per forward and every layer reuses them::

    extend  request i:  q = its extend_lens[i] new rows     k/v = pool[context_slots[i]]
                        new token t (0-based) sees context 0 .. prefix_len + t
    decode  all:        q [B, H, 1, D]                       k/v = pool[padded slots] [B, Hkv, S_max, D]
                        mask [B, 1, 1, S_max]: True on each request's real context
    mixed   one step:       prefill chunks (extend rows) next to running decodes (one row each);
                            each request takes its own path, its output goes back to its rows

Grouped-query attention goes through SDPA's ``enable_gqa``: K/V heads are never
repeated in memory.

Each layer has its own window, soft cap and scale (attention_params.py: Gemma alternates
windowed and global layers). The kernels apply them per call; the gather paths read, for a
windowed layer, only each request's keys in the window (``Routes.windowed``, built once per
step for each window the layers have).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.memory.kv_pool import KVPool
from radixserve.model.attention_params import AttentionParams
from radixserve.model.config import ModelConfig
from radixserve.model.forward import ForwardBatch
from radixserve.model.gather import GatherWorkspace, extend_attention_reference, grouped_matmul_attention
from radixserve.model.layers import FUSED_DTYPES, apply_rotary, fused_ops_apply, linear_add, make_norm, uninitialised
from radixserve.model.paged_kernel import PagedIndex, extend_attention, extend_kernel_built, paged_attention
from radixserve.model.precision import CpuFeatures


@dataclass(frozen=True)
class ExtendSpan:
    """One request in an extend step: its rows in the flattened batch and its context."""

    start: int
    end: int
    context_slots: torch.Tensor  # [ctx_len]; with a window, from the first key any of its rows sees
    mask: torch.Tensor | None  # [extend_len, ctx_len] bool; None for a cold prefill (plain causal)


@dataclass(frozen=True)
class DecodeGroup:
    """Reference decode: the one-row requests at once, contexts padded to the longest."""

    padded_slots: torch.Tensor  # [B, S_max]; padding points at slot 0; with a window, its last keys only
    mask: torch.Tensor | None  # [B, 1, 1, S_max] bool; None when all lengths are equal


# A request extending by more rows than this goes through gather + SDPA: the copy of its
# context is amortised over its rows, and SDPA's blocked kernel beats the paged kernel's
# per-row loops there. Decode and short extends (speculative, mixed-in) read in place.
# Where the extend kernel applies (bf16 on an AVX512-BF16 CPU), it takes every extend instead.
PAGED_MAX_EXTEND_LEN = 8
# A step that wants only each request's last row computes the last layer's attention, o_proj and MLP for a
# tail of rows (tail_lens); every row still writes its K/V. At least this many rows in all, so each linear
# takes the path all the step's rows take (the block kernels run up to 16 or 48 rows, the GEMMs past them).
TAIL_MIN_ROWS = 64


def tail_lens(extend_lens: list[int]) -> list[int] | None:
    """How many of its last rows each request keeps in the last layer of a step whose logits are only each
    request's last row; None where that is every row (a step of TAIL_MIN_ROWS rows or fewer).

    The step's last TAIL_MIN_ROWS rows and each request's last row, and enough rows that no request changes
    route (Routes.build: a request of up to PAGED_MAX_EXTEND_LEN rows keeps them all, a longer one at least
    one more). Each request keeps a suffix of its rows: to attention, an extend on a longer cached prefix,
    which the extend kernel computes with the same bits (extend_attention.h)."""
    total = sum(extend_lens)
    if total <= TAIL_MIN_ROWS:
        return None
    kept, start = [], 0
    for n in extend_lens:
        in_tail = max(0, start + n - max(start, total - TAIL_MIN_ROWS))
        kept.append(max(in_tail, n if n <= PAGED_MAX_EXTEND_LEN else PAGED_MAX_EXTEND_LEN + 1))
        start += n
    return kept if sum(kept) < total else None


@dataclass(frozen=True)
class Routes:
    """Which path each request of a step takes, and the indices and masks each path needs.

    Four groups, any of them empty: ``extend`` (the bf16 extend kernel, paged_kernel.extend_attention:
    every prefill chunk, where it applies), ``paged`` (the paged kernel reads the pool in place: decode
    rows, and short extends where the extend kernel does not apply), ``decode`` (reference: one-row
    requests of a decode or mixed step, padded), ``spans`` (gather + SDPA per request: long extends,
    and every extend on the reference backend). ``*_rows``: the query rows a group owns, None when it
    owns all. A mixed step (prefill chunks next to decodes) is one set of routes with several groups.
    """

    spans: list[ExtendSpan]
    span_rows: torch.Tensor | None = None
    decode: DecodeGroup | None = None
    decode_rows: torch.Tensor | None = None
    paged: PagedIndex | None = None
    paged_rows: torch.Tensor | None = None
    extend: PagedIndex | None = None
    extend_rows: torch.Tensor | None = None
    decode_members: tuple[int, ...] = ()  # the requests (indices into the batch) of ``decode`` and ``spans``
    span_members: tuple[int, ...] = ()

    @classmethod
    def build(
        cls, batch: ForwardBatch, backend: str, cascade: bool, extend_kernel: bool, paged_extends: bool = False
    ) -> Routes:
        """``extend_kernel``: the bf16 extend kernel takes every extend request (a prefill chunk, a
        cache hit's tail), but not the one-row requests of a mixed step, which are decodes. ``paged_extends``:
        the paged kernel takes every extend the extend kernel does not (split invariance where it does not run:
        gather + SDPA's bits depend on the extend's length)."""
        groups: dict[str, list[int]] = {"extend": [], "paged": [], "decode": [], "spans": []}
        for i, extend_len in enumerate(batch.extend_lens):
            if extend_kernel and (batch.mode == "extend" or (batch.mode == "mixed" and extend_len > 1)):
                groups["extend"].append(i)
            elif backend == "paged" and (extend_len <= PAGED_MAX_EXTEND_LEN or paged_extends):
                groups["paged"].append(i)
            elif batch.mode == "decode" or (batch.mode == "mixed" and extend_len == 1):
                groups["decode"].append(i)
            else:
                groups["spans"].append(i)
        starts = [0, *accumulate(batch.extend_lens)]
        rows = {name: _rows(members, starts, batch) for name, members in groups.items()}
        indices = {}
        for name in ("paged", "extend"):
            contexts = [batch.context_slots[i] for i in groups[name]]
            lens = [batch.extend_lens[i] for i in groups[name]]
            solo = [batch.solo[i] for i in groups[name]] if batch.solo else None
            indices[name] = PagedIndex.build(contexts, lens, cascade and name == "paged", solo) if contexts else None
        return cls(
            [],
            rows["spans"],
            None,
            rows["decode"],
            indices["paged"],
            rows["paged"],
            indices["extend"],
            rows["extend"],
            tuple(groups["decode"]),
            tuple(groups["spans"]),
        ).windowed(batch, 0)

    def windowed(self, batch: ForwardBatch, window: int) -> Routes:
        """These routes with the gather paths' slots and masks for a layer of this window (0: none): each
        reads only the keys its rows see. The kernels' indices are the same for every window."""
        contexts, params = batch.context_slots, AttentionParams(window)
        decode = _decode_group([contexts[i] for i in self.decode_members], window) if self.decode_members else None
        spans, start = [], 0
        for i in self.span_members:
            extend_len = batch.extend_lens[i]
            spans.append(_span(start, extend_len, contexts[i], params))
            start += extend_len
        return dataclasses.replace(self, spans=spans, decode=decode)


@dataclass(frozen=True)
class AttentionPlan:
    """One step's batch and its routes, shared by every layer.

    The routes are built at the first layer, once per step: whether the extend kernel applies
    depends on q's and the pool's dtypes, which the plan learns there.
    """

    workspace: GatherWorkspace
    batch: ForwardBatch
    backend: str = "reference"
    cascade: bool = True
    paged_extends: bool = False  # Routes.build: every extend the extend kernel does not take reads in place
    _routes: dict[tuple[bool, int], Routes] = field(default_factory=dict, compare=False, repr=False)
    # Per-step decisions that depend only on the step's dtypes and devices, which every layer shares: made at the
    # first layer (``fused_write``, ``layer_routes``), then read.
    _decided: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        workspace: GatherWorkspace,
        backend: str = "reference",
        cascade: bool = True,
        paged_extends: bool = False,
    ) -> AttentionPlan:
        """``backend``: "paged" (in place, where a request suits it) or "reference" (gather + SDPA).
        ``cascade``: the paged kernel reads a prefix that several requests share once for all of them.
        ``paged_extends``: the paged kernel takes every extend the bf16 extend kernel does not (split invariance)."""
        return cls(workspace, batch, backend, cascade, paged_extends)

    def fused_write(self, qkv: torch.Tensor, cos: torch.Tensor, kv_pool: KVPool) -> bool:
        """Whether the fused rotary + K/V write (KVPool.write_rotated) takes this step's qkv: cos in qkv's dtype,
        a float or int8 pool (an fp8 pool takes KVPool.write), the fused ops built. Decided at the first layer: every
        layer's qkv, cos and pool dtype are the same."""
        fused = self._decided.get("fused_write")
        if fused is None:
            pool_ok = kv_pool.dtype in (*FUSED_DTYPES, torch.int8)
            fused = self._decided["fused_write"] = cos.dtype == qkv.dtype and pool_ok and fused_ops_apply(qkv)
        return fused

    def layer_routes(self, q: torch.Tensor, kv_pool: KVPool, window: int = 0) -> Routes:
        """``routes`` for a layer's q: with the extend kernel where it applies to q and the pool (decided once)."""
        applies = self._decided.get("extend_kernel")
        if applies is None:
            applies = self._decided["extend_kernel"] = extend_kernel_applies(q, kv_pool)
        return self.routes(applies, window)

    def routes(self, extend_kernel: bool, window: int = 0) -> Routes:
        """The step's routes, with or without the extend kernel, for layers of this window (built on first
        use, then reused)."""
        extend_kernel = extend_kernel and self.backend == "paged"
        key = (extend_kernel, window)
        if key not in self._routes:
            if window:
                self._routes[key] = self.routes(extend_kernel).windowed(self.batch, window)
            else:
                self._routes[key] = Routes.build(
                    self.batch, self.backend, self.cascade, extend_kernel, self.paged_extends
                )
        return self._routes[key]


def _rows(members: list[int], starts: list[int], batch: ForwardBatch) -> torch.Tensor | None:
    """The query rows of ``members`` (request indices), in order; None when they are every request."""
    if len(members) == batch.batch_size:
        return None
    ranges = [torch.arange(starts[i], starts[i + 1]) for i in members]
    return torch.cat(ranges).to(batch.input_ids.device) if ranges else None


def _span(start: int, extend_len: int, slots: torch.Tensor, params: AttentionParams) -> ExtendSpan:
    """Its rows' mask: causal, shifted right by the cached prefix, within the window; the keys from the first
    any row sees. A cold prefill that the window hides nothing of is plain causal (no mask)."""
    ctx_len = slots.shape[0]
    prefix_len = ctx_len - extend_len
    if prefix_len == 0 and ctx_len <= (params.window or ctx_len):
        return ExtendSpan(start, start + extend_len, slots, None)
    first, device = params.first_key(ctx_len, extend_len), slots.device
    mask = params.mask(torch.arange(prefix_len, ctx_len, device=device), torch.arange(first, ctx_len, device=device))
    return ExtendSpan(start, start + extend_len, slots[first:], mask)


def _decode_group(context_slots: list[torch.Tensor], window: int) -> DecodeGroup:
    if window:  # a decode row sees its last ``window`` keys
        context_slots = [slots[-window:] for slots in context_slots]
    lens = [slots.shape[0] for slots in context_slots]
    padded = nn.utils.rnn.pad_sequence(context_slots, batch_first=True, padding_value=0)
    mask = None
    if min(lens) != max(lens):
        device = padded.device
        lens_t = torch.tensor(lens, device=device)
        mask = (torch.arange(max(lens), device=device)[None, :] < lens_t[:, None])[:, None, None, :]
    return DecodeGroup(padded, mask)


@functools.cache
def extend_kernel_usable() -> bool:
    """This CPU has AVX512-BF16 (asked at run time) and the kernel was built with it."""
    return CpuFeatures.detect().avx512_bf16 and extend_kernel_built()


def extend_kernel_applies(q: torch.Tensor, kv_pool: KVPool) -> bool:
    """bf16 queries on a bf16 or 8-bit pool on such a CPU. Everything else (float32 anywhere, a bf16 pool under
    float32 weights, AVX2-only CPUs, CUDA) keeps the paged kernel and gather + SDPA."""
    bf16 = torch.bfloat16
    if q.device.type != "cpu" or q.dtype != bf16 or kv_pool.dtype not in (bf16, torch.int8) or q.shape[-1] % 16 != 0:
        return False  # the kernel packs K/V 16 head dims at a time
    return extend_kernel_usable()


def attention_split_invariance(
    dtype: torch.dtype, kv_dtype: torch.dtype, backend: str, head_dim: int
) -> tuple[bool, str | None]:
    """(whether every extend must read in place through the paged kernel, None) when a query's attention output
    does not depend on where its request's cached prefix ends or which rows share its step, else (False, why not).
    In bfloat16 on an AVX512-BF16 CPU the extend kernel takes every extend (keys in blocks aligned to absolute
    positions, extend_attention.h); elsewhere (float32, no AVX512-BF16) the paged kernel does, whose sums run in
    an order fixed by the keys' positions (paged_avx512.h), instead of gather + SDPA, whose bits depend on the
    extend's length. The shared-prefix pass is never invariant: the caller turns it off."""
    if backend == "reference":
        return False, "the reference attention backend (gather + SDPA) is not split-invariant"
    extend_kernel = dtype == torch.bfloat16 and kv_dtype in (torch.bfloat16, torch.int8) and head_dim % 16 == 0
    return not (extend_kernel and extend_kernel_usable()), None


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads, reading and writing the KV pool."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        device: torch.device,
        dtype: torch.dtype,
        params: AttentionParams | None = None,
    ) -> None:
        """``params``: this layer's window, soft cap and scale (attention_params.py); None: the config's."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        hidden = config.hidden_size
        self.qkv_proj = uninitialised(
            nn.Linear, hidden, q_size + 2 * kv_size, bias=config.attention_bias, device=device, dtype=dtype
        )
        self.o_proj = uninitialised(nn.Linear, q_size, hidden, bias=config.o_proj_bias, device=device, dtype=dtype)
        # qwen3, gemma3: RMSNorm over each head of q and k, before rotary
        self.q_norm = make_norm(config, self.head_dim, device, dtype) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim, device, dtype) if config.qk_norm else None
        self.qk_norm = config.qk_norm  # a plain attribute: the step reads it without nn.Module.__getattr__
        self.params = params or AttentionParams(
            config.layer_window(layer_id), float(config.attn_logit_softcapping or 0.0), config.attention_scale()
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
        kv_pool: KVPool,
        residual: torch.Tensor | None,
        overwrite_residual: bool = False,
        tail: tuple[torch.Tensor, AttentionPlan] | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> residual + attention(x) [T, hidden] (attention(x) alone where ``residual`` is None);
        writes the new tokens' K/V at ``out_slots`` first. ``overwrite_residual``: the caller no longer needs
        ``residual`` (see layers.linear_add). ``tail``: rows and their plan (ForwardBatch.tail): every row's K/V
        is written, then only those rows attend and are returned ([len(rows), hidden])."""
        qkv = self.qkv_proj.forward(x)  # forward, not __call__: see DecoderLayer.forward
        num_rows = x.shape[0]
        if self.qk_norm:
            self._norm_qk(qkv)
        if plan.fused_write(qkv, cos, kv_pool):
            q = kv_pool.write_rotated(self.layer_id, out_slots, qkv, cos, sin, self.num_heads)
        else:
            qk_size = self.split_sizes[0] + self.split_sizes[1]
            # q and k are adjacent in the fused output: rotate both heads-wise in one set of ops.
            qk = apply_rotary(qkv[:, :qk_size].view(num_rows, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, qk_size:].view(num_rows, self.num_kv_heads, self.head_dim)
            kv_pool.write(self.layer_id, out_slots, k, v)
        if tail is not None:
            rows, plan = tail
            q = q[rows]
            residual = None if residual is None else residual[rows]
        out = self._attend(q, plan, kv_pool).reshape(q.shape[0], -1)
        if residual is None:
            attended: torch.Tensor = self.o_proj.forward(out)
            return attended
        return linear_add(self.o_proj, out, residual, overwrite_residual)

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """RMSNorm each head of q and k in place in ``qkv`` [T, q | k | v] (before rotary)."""
        assert self.q_norm is not None and self.k_norm is not None
        q_size, kv_size = self.split_sizes[0], self.split_sizes[1]
        num_rows = qkv.shape[0]
        q = qkv[:, :q_size].reshape(num_rows, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(num_rows, self.num_kv_heads, self.head_dim)
        qkv[:, :q_size] = self.q_norm.forward(q).reshape(num_rows, q_size)
        qkv[:, q_size : q_size + kv_size] = self.k_norm.forward(k).reshape(num_rows, kv_size)

    def _extend_one(
        self, q: torch.Tensor, span: ExtendSpan, workspace: GatherWorkspace, kv_pool: KVPool
    ) -> torch.Tensor:
        """One request: q [L, H, D] against its context [Hkv, S, D] -> [L, H, D]."""
        k, v = workspace.gather(kv_pool, self.layer_id, span.context_slots)
        return extend_attention_reference(q, k, v, span.mask, self.params)

    def _attend(self, q: torch.Tensor, plan: AttentionPlan, kv_pool: KVPool) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]: each group of requests on its path, written back to its rows."""
        routes = plan.layer_routes(q, kv_pool, self.params.window)
        layer = self.layer_id
        k_pool, v_pool = kv_pool.k[layer], kv_pool.v[layer]
        scales = (kv_pool.k_scale[layer], kv_pool.v_scale[layer]) if kv_pool.quantized else None  # read in place
        parts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for index, rows, kernel in (
            (routes.extend, routes.extend_rows, extend_attention),
            (routes.paged, routes.paged_rows, paged_attention),
        ):
            if index is not None:
                q_part = q if rows is None else q[rows]
                parts.append((rows, kernel(q_part, k_pool, v_pool, index, self.params, scales)))
        if routes.decode is not None:
            rows = routes.decode_rows
            parts.append((rows, self._decode(q if rows is None else q[rows], routes.decode, plan.workspace, kv_pool)))
        if routes.spans:
            q_spans = q if routes.span_rows is None else q[routes.span_rows]
            extend = [self._extend_one(q_spans[s.start : s.end], s, plan.workspace, kv_pool) for s in routes.spans]
            parts.append((routes.span_rows, torch.cat(extend)))
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        out = torch.empty_like(q)
        for rows, part in parts:
            out[rows] = part
        return out

    def _decode(self, q: torch.Tensor, group: DecodeGroup, workspace: GatherWorkspace, kv_pool: KVPool) -> torch.Tensor:
        """One row per request: q [B, H, D] against padded contexts [B, Hkv, S_max, D] -> [B, H, D]."""
        k, v = workspace.gather(kv_pool, self.layer_id, group.padded_slots)
        k, v = k.to(q.dtype), v.to(q.dtype)  # the pool may store another dtype
        if (q.dtype == torch.bfloat16 and q.device.type == "cpu") or self.params.softcap:
            return grouped_matmul_attention(q, k, v, group.mask, self.params)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=group.mask, enable_gqa=True, scale=self.params.scale
        )
        return out[:, :, 0, :]
