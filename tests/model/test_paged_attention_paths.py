"""The paged kernel's AVX2 + FMA path (csrc/paged_avx2.h: CPUs with AVX2 and without AVX512), for each pool dtype
(float32, bfloat16, int8 with its scales): against float64 attention over the values the pool holds, and a row's bits
against itself run as a decode, in extend tiles cut anywhere, and beside other requests. (Where AVX512 runs, extends
take the extend kernel, whose invariance test_attention_window_invariance.py and test_extend_attention.py check.)

Head dims 64 (SmolLM2) and 128, groups of 3 (SmolLM2) and 1; contexts of a few hundred keys, so the passes' key
blocks end anywhere in a row's keys, and an extend of 21 tokens (tiles of 8, 8 and 5 rows a head) whose rows see
different keys of one tile. With a window the tile's rows also start at different keys.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixserve.memory.kv_pool import KVPool
from radixserve.model import paged_kernel
from radixserve.model.attention_params import AttentionParams
from radixserve.model.paged_kernel import PagedIndex, paged_attention
from tests.model.test_gguf_rows_avx2 import avx2_path

pytestmark = [
    pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the paged kernel cannot build"),
    pytest.mark.skipif(not avx2_path(), reason="the AVX2 path runs on CPUs with AVX2 and without AVX512"),
]

POOLS = [torch.float32, torch.bfloat16, torch.int8]
# Of the largest output, against float64 (measured on AVX2 + FMA: float32 and bfloat16 pools <= 1.8e-6, int8
# <= 2.2e-6).
BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-5, torch.int8: 1e-5}
PREFIX, EXTEND = 300, 21


def make_pool(dtype: torch.dtype, kv_heads: int, head_dim: int, num_slots: int) -> KVPool:
    """One layer of random K/V, rows of several magnitudes (an 8-bit pool's scales then differ)."""
    pool = KVPool(1, num_slots, kv_heads, head_dim, dtype)
    generator = torch.Generator().manual_seed(11)
    k, v = torch.randn(2, num_slots, kv_heads, head_dim, generator=generator)
    magnitude = torch.rand(2, num_slots, kv_heads, 1, generator=generator) * 3 + 0.1
    pool.write(0, torch.arange(num_slots), k * magnitude[0], v * magnitude[1])
    return pool


def held(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K/V as the values it holds, in float64: [Hkv, N, D]."""
    if pool.quantized:
        return (
            pool.k[0].double() * pool.k_scale[0].double()[..., None],
            pool.v[0].double() * pool.v_scale[0].double()[..., None],
        )
    return pool.k[0].double(), pool.v[0].double()


def as_int8_rows(q: torch.Tensor) -> torch.Tensor:
    """q as the 8-bit pool's scores pass reads it (scores_int8_avx2.h): each row times the head's scale, quantized to
    int8 codes with one scale max|row| / 127 (in float32, as the kernel does), given back unscaled in float64."""
    scale = torch.tensor(q.shape[-1] ** -0.5, dtype=torch.float32)
    x = q.float() * scale
    mx = x.abs().amax(-1, keepdim=True)
    codes = torch.round(x * (127.0 / mx)).clamp(-127, 127)
    return codes.double() * (mx / 127.0).double() / scale.double()


def run(
    pool: KVPool, q: torch.Tensor, contexts: list[torch.Tensor], lens: list[int], params: AttentionParams
) -> torch.Tensor:
    index = dataclasses.replace(PagedIndex.build(contexts, lens, cascade=False), num_splits=1)
    scales = (pool.k_scale[0], pool.v_scale[0]) if pool.quantized else None
    return paged_attention(q, pool.k[0], pool.v[0], index, params, scales=scales)


def float64_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, extend_len: int, window: int
) -> torch.Tensor:
    """One request's rows [T, H, D] in float64: causal over its context, keys of a window only within it."""
    heads, kv_heads, dim = q.shape[1], k.shape[0], q.shape[2]
    kk = k[:, slots].repeat_interleave(heads // kv_heads, 0)
    vv = v[:, slots].repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("thd,hnd->htn", q.double(), kk) * dim**-0.5
    position = torch.arange(extend_len)[:, None] + slots.shape[0] - extend_len
    key = torch.arange(slots.shape[0])[None, :]
    visible = (key <= position) & ((key > position - window) if window else True)
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("htn,hnd->thd", p, vv)


@pytest.mark.parametrize("dtype", POOLS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 128), (2, 2, 64), (4, 2, 96)])
@pytest.mark.parametrize("window", [0, 100])
def test_each_pool_dtype_is_float64_close(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int
) -> None:
    pool = make_pool(dtype, kv_heads, head_dim, 1024)
    slots = torch.randperm(1023, generator=torch.Generator().manual_seed(12))[: PREFIX + EXTEND] + 1
    contexts = [slots, slots[:37], slots[: PREFIX + 1]]  # an extend, a short decode, a long one
    lens = [EXTEND, 1, 1]
    q = torch.randn(sum(lens), heads, head_dim, generator=torch.Generator().manual_seed(13))
    got = run(pool, q, contexts, lens, AttentionParams(window=window))
    k, v = held(pool)
    seen = as_int8_rows(q) if dtype == torch.int8 else q  # the int8 pool's scores read q as int8 codes
    starts = [0, EXTEND, EXTEND + 1, EXTEND + 2]
    expected = torch.cat(
        [float64_attention(seen[a:b], k, v, c, n, window) for a, b, c, n in zip(starts, starts[1:], contexts, lens)]
    )
    assert (got.double() - expected).abs().max().item() <= BOUND[dtype] * expected.abs().max().item()


@pytest.mark.parametrize("dtype", POOLS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 128), (4, 2, 96)])
@pytest.mark.parametrize("window", [0, 100])
def test_a_row_has_the_same_bits_as_a_decode_in_a_tile_and_in_a_batch(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, window: int
) -> None:
    """Each of an extend's rows: the bits of the whole extend, of pieces cut anywhere (so a row sits at any place of
    its tile, beside rows that see other keys), of one decode row, and of the extend beside other requests."""
    pool = make_pool(dtype, kv_heads, head_dim, 1024)
    slots = torch.randperm(1023, generator=torch.Generator().manual_seed(14))[: PREFIX + EXTEND + 200] + 1
    mine, others = slots[: PREFIX + EXTEND], [slots[PREFIX + EXTEND :], slots[PREFIX + EXTEND : PREFIX + EXTEND + 90]]
    q = torch.randn(EXTEND + 9, heads, head_dim, generator=torch.Generator().manual_seed(15))
    params = AttentionParams(window=window)

    def piece(start: int, stop: int) -> torch.Tensor:
        return run(pool, q[start:stop], [mine[: PREFIX + stop]], [stop - start], params)

    whole = piece(0, EXTEND)
    for cuts in ([0, 3, EXTEND], [0, 5, 6, 15, EXTEND], list(range(EXTEND + 1))):
        assert torch.equal(torch.cat([piece(a, b) for a, b in zip(cuts, cuts[1:])]), whole)
    rows = torch.cat([q[EXTEND : EXTEND + 1], q[:EXTEND], q[EXTEND + 1 :]])
    beside = run(pool, rows, [others[0], mine, others[1]], [1, EXTEND, 8], params)
    assert torch.equal(beside[1 : 1 + EXTEND], whole)
