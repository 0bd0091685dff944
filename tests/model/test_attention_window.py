"""A sliding window, a logit soft cap and a scale (attention_params.py) on every attention path.

Each route a step can take (the paged kernel with and without a shared prefix, the bf16 extend
kernel, gather + SDPA per request, the padded decode group: SDPA in float32, matmuls in bf16 or
with a soft cap) against a masked softmax computed by hand in float64, in float32 and bfloat16 pools,
one batch holding contexts shorter than, equal to and longer than the window, decode rows and
extends, cold and on cached prefixes, GQA. The K/V that no row's window holds is NaN in the pool:
a path that read it would return NaN (a window's point is that a step reads only the window).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model import paged_kernel
from radixserve.model.attention import Attention, AttentionPlan, extend_kernel_usable
from radixserve.model.attention_params import AttentionParams
from radixserve.model.config import ModelConfig
from radixserve.model.gather import GatherWorkspace
from radixserve.model.paged_kernel import PagedIndex, extend_attention, paged_attention
from tests.model.test_paged_attention import slot_taker
from tests.model.tiny import make_batch

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 6, 2, 64, 32
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # bf16: the output's own rounding
PARAMS = {
    "window": AttentionParams(window=WINDOW),
    "softcap": AttentionParams(softcap=4.0),
    "window_softcap_scale": AttentionParams(window=WINDOW, softcap=4.0, scale=0.1),
    "window_past_every_context": AttentionParams(window=4096, softcap=2.0),  # shared prefixes stay shared
}
BACKENDS = ["reference", pytest.param("paged", marks=pytest.mark.skipif(not paged_kernel.load(), reason="no kernel"))]


def reference64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    contexts: list[torch.Tensor],
    lens: list[int],
    params: AttentionParams,
) -> torch.Tensor:
    """Per request, in float64: scores * scale, the soft cap, -inf where a key is in the future or out of the
    query's window (keys p - W + 1 .. p), softmax, times V; query heads share K/V heads in groups."""
    out, start, group = [], 0, q.shape[1] // k.shape[0]
    scale = params.scale if params.scale is not None else q.shape[-1] ** -0.5
    for slots, extend_len in zip(contexts, lens):
        positions = torch.arange(extend_len)[:, None] + slots.shape[0] - extend_len
        keys = torch.arange(slots.shape[0])[None, :]
        visible = (keys <= positions) & ((keys > positions - params.window) if params.window else True)
        kk = k[:, slots].double().repeat_interleave(group, 0)
        vv = v[:, slots].double().repeat_interleave(group, 0)
        scores = torch.einsum("lhd,hsd->hls", q[start : start + extend_len].double(), kk) * scale
        if params.softcap:
            scores = params.softcap * torch.tanh(scores / params.softcap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("hls,hsd->lhd", probs, vv))
        start += extend_len
    return torch.cat(out)


def unseen_slots(contexts: list[torch.Tensor], lens: list[int], window: int) -> torch.Tensor:
    """The context slots no new token of any request sees (before every window that holds them)."""
    seen = set()
    for slots, extend_len in zip(contexts, lens):
        first = max(0, slots.shape[0] - extend_len + 1 - window) if window else 0
        seen.update(slots[first:].tolist())
    every = set(torch.cat(contexts).tolist())
    return torch.tensor(sorted(every - seen), dtype=torch.int64)


def window_batch(page_size: int, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """(context slots, extend length) per request: decodes on contexts shorter than, equal to and far longer
    than WINDOW, three members of a 100-slot shared prefix (two decoding, one extending), cold prefills
    shorter and longer than WINDOW, extends on cached prefixes short and long; shuffled."""
    rng = np.random.default_rng(seed)
    take = slot_taker(4096, page_size, rng)
    shared = take(100)
    items = [(take(prefix_len), extend_len) for prefix_len, extend_len in ((10, 1), (31, 1), (200, 1))]
    items += [(shared, 1), (shared, 1), (shared, 3)]
    items += [(take(prefix_len), extend_len) for prefix_len, extend_len in ((0, 20), (0, 80), (50, 5), (300, 40))]
    order = rng.permutation(len(items))
    contexts = [torch.cat([items[i][0], take(items[i][1])]) for i in order]
    return contexts, [items[i][1] for i in order]


def attend(
    q: torch.Tensor,
    pool: KVPool,
    contexts: list[torch.Tensor],
    lens: list[int],
    mode: str,
    backend: str,
    params: AttentionParams,
) -> torch.Tensor:
    """One layer's attention on a step of these requests, routed as the model routes it (``_attend``: each
    group of requests on its path; the projections around it are not what is tested here)."""
    config = ModelConfig("llama", 8, HEADS * HEAD_DIM, 8, 1, HEADS, KV_HEADS, HEAD_DIM)
    layer = Attention(config, 0, torch.device("cpu"), pool.dtype, params)
    batch = make_batch(mode, [([0] * n, slots) for slots, n in zip(contexts, lens)])
    return layer._attend(q, AttentionPlan.build(batch, GatherWorkspace(), backend), pool)


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["mixed", "extend"])
def test_every_route_equals_a_float64_masked_softmax_and_reads_only_the_window(
    params: AttentionParams, dtype: torch.dtype, backend: str, mode: str
) -> None:
    """mixed: one-row requests are decodes (decode group, or the paged kernel), the rest extends; extend: all
    are extends (the bf16 extend kernel takes them all where it applies). Pages of 16 on seed 1."""
    for seed in (0, 1):
        contexts, lens = window_batch(16 if seed else 1, seed)
        pool = KVPool(1, 4096 + 16, KV_HEADS, HEAD_DIM, dtype=dtype)
        generator = torch.Generator().manual_seed(seed)
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=generator))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=generator))
        q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator).to(dtype)
        expected = reference64(q, pool.k[0], pool.v[0], contexts, lens, params)
        unseen = unseen_slots(contexts, lens, params.window)
        assert unseen.numel() > (0 if params.window == WINDOW else -1)
        pool.k[0][:, unseen] = float("nan")
        pool.v[0][:, unseen] = float("nan")
        for threads in (1, 2):  # 2 threads: the paged kernel splits long decode contexts
            torch.set_num_threads(threads)
            try:
                got = attend(q, pool, contexts, lens, mode, backend, params)
            finally:
                torch.set_num_threads(1)
            assert got.dtype == dtype and got.shape == q.shape
            assert (got.double() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["mixed", "extend"])
def test_a_window_past_every_context_changes_no_bit(dtype: torch.dtype, backend: str, mode: str) -> None:
    """Every path reads the same keys the same way as without a window (the shared prefix stays shared)."""
    contexts, lens = window_batch(1, 2)
    pool = KVPool(1, 4096 + 16, KV_HEADS, HEAD_DIM, dtype=dtype)
    generator = torch.Generator().manual_seed(2)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=generator))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=generator))
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator).to(dtype)
    for softcap in (0.0, 3.0):
        plain = attend(q, pool, contexts, lens, mode, backend, AttentionParams(softcap=softcap))
        wide = attend(q, pool, contexts, lens, mode, backend, AttentionParams(window=4096, softcap=softcap))
        assert torch.equal(plain, wide)


@pytest.mark.skipif(not paged_kernel.load(), reason="no kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 96), (4, 1, 256), (6, 2, 48), (4, 4, 128)])
def test_the_kernels_head_dims_equal_a_float64_masked_softmax(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Phi-3's 96 and Gemma's 256 (the vector loops), 48 (the portable ones), MHA: the paged and extend kernels."""
    contexts, lens = window_batch(1, 3)
    generator = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, kv_heads, 4096 + 16, head_dim, generator=generator).to(dtype)
    q = torch.randn(sum(lens), heads, head_dim, generator=generator).to(dtype)
    for params in PARAMS.values():
        expected = reference64(q, k, v, contexts, lens, params)
        got = [paged_attention(q, k, v, PagedIndex.build(contexts, lens), params)]
        if dtype == torch.bfloat16 and extend_kernel_usable() and head_dim % 16 == 0:
            got.append(extend_attention(q, k, v, PagedIndex.build(contexts, lens, cascade=False), params))
        for out in got:
            assert (out.double() - expected).abs().max().item() <= TOLERANCE[dtype]


def test_params_are_validated_and_default_to_plain_attention() -> None:
    assert AttentionParams().kernel_scale(64) == 64**-0.5 and AttentionParams(scale=0.5).kernel_scale(64) == 0.5
    assert AttentionParams(window=3).first_key(ctx_len=10, extend_len=2) == 6  # position 8 sees 6, 7, 8
    mask = AttentionParams(window=3).mask(torch.tensor([8, 9]), torch.arange(6, 10))
    assert mask.tolist() == [[True, True, True, False], [False, True, True, True]]
    for bad in ({"window": -1}, {"softcap": -1.0}, {"scale": 0.0}):
        with pytest.raises(ValueError, match="window and softcap"):
            AttentionParams(**bad)  # type: ignore[arg-type]
