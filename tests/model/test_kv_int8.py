"""The 8-bit KV pool (``--kv-cache-dtype int8``): what it stores, and every attention path reading it in place.

The kernels read int8 codes and fold each row's scale into its score (K) and its softmax weight (V); the
references here run float32 SDPA on the same pool dequantized (codes * scale), so the kernels must match
them to float32 rounding and the paged kernel's two quantizations (q against the key codes: int8, 2^-8 of a
row's max, with AVX512-VNNI, else int16; the softmax weights against the value codes: int16, 2^-15 of the
largest in each 16-key block) or to bf16 rounding (the extend kernel, which packs code * scale in bf16). Query
rows that are int8 codes already lose nothing to the first: there the paged kernel meets the reference to 1e-4.
Then what the engine promises within one KV dtype: a cache hit and a mixed step give the same bits as a cold
prefill and the steps apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.engine.config import EngineConfig
from radixserve.memory.kv_pool import KVPool
from radixserve.model import paged_kernel
from radixserve.model.attention import extend_kernel_usable
from radixserve.model.layers import apply_rotary
from radixserve.model.paged_kernel import PagedIndex, extend_attention, paged_attention
from radixserve.model.precision import resolve_kv_cache_dtype
from tests.model.test_extend_attention import random_layout
from tests.model.test_fused_ops import _rotary_inputs
from tests.model.test_paged_attention import HEAD_DIM, HEADS, KV_HEADS, layout, reference
from tests.model.test_shared_prefix import cascade_layout
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

needs_paged = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the paged kernel cannot build")
needs_extend = pytest.mark.skipif(not extend_kernel_usable(), reason="the CPU lacks AVX512-BF16 (or no compiler)")


# Of the largest output: the paged kernel's suffix rows against dequantized SDPA with q quantized to int8 per row
# (scores_int8.h). The kernel's arithmetic beyond that rounding is pinned at 1e-4 by the int8-exact rows' test.
Q_INT8_TOLERANCE = 2.5e-2


def int8_pool(num_slots: int, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, seed: int = 0) -> KVPool:
    """One layer of an 8-bit pool holding random K/V (rows of different magnitudes: the scales matter)."""
    pool = KVPool(1, num_slots, kv_heads, head_dim, torch.int8)
    generator = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, num_slots, kv_heads, head_dim, generator=generator)
    magnitude = torch.rand(2, num_slots, kv_heads, 1, generator=generator) * 4 + 0.05
    pool.write(0, torch.arange(num_slots), k * magnitude[0], v * magnitude[1])
    return pool


def dequantized(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = pool.dequantized(0, torch.arange(pool.num_slots), torch.float32)
    return k, v


def assert_close(got: torch.Tensor, expected: torch.Tensor, relative: float) -> None:
    """Within ``relative`` of the largest expected value (the rows are of several magnitudes)."""
    error = (got.float() - expected).abs().max().item()
    assert error <= relative * expected.abs().max().item(), error


def scales(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.k_scale[0], pool.v_scale[0]


def test_the_pool_stores_int8_codes_with_one_bfloat16_scale_per_token_and_head() -> None:
    pool = KVPool(2, 64, 3, 64, torch.int8)
    generator = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 5, 3, 64, generator=generator) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    slots = torch.tensor([3, 4, 9, 10, 11])
    pool.write(1, slots, k, v)
    assert (
        pool.k[1].dtype == torch.int8 and pool.k_scale[1].shape == (3, 64) and pool.k_scale[1].dtype == torch.bfloat16
    )
    got_k, got_v = pool.dequantized(1, slots, torch.float32)
    for got, want in ((got_k, k), (v.new_zeros(0), v.new_zeros(0)), (got_v, v)):
        if got.numel():
            step = want.abs().amax(-1, keepdim=True).transpose(0, 1) / 127  # the row's scale, about
            assert ((got - want.transpose(0, 1)).abs() <= step * 0.51).all()
    assert pool.k[1].abs().amax().item() == 127 and not pool.k[0].any()  # absmax hits the edge; other layer untouched
    rows = pool.gather_rows(slots)
    assert rows.shape == (2, 2, 3, 5, 66)  # 64 codes + the scale's 2 bytes
    copy = KVPool(2, 64, 3, 64, torch.int8)
    copy.scatter_rows(slots, rows)
    every = pool.k + pool.v + pool.k_scale + pool.v_scale
    assert all(torch.equal(a, b) for a, b in zip(every, copy.k + copy.v + copy.k_scale + copy.v_scale))


def test_the_8bit_pool_holds_at_least_1_9x_the_tokens_of_bfloat16_per_gib() -> None:
    for layers, heads, head_dim in ((30, 3, 64), (32, 8, 128)):  # SmolLM2-135M, Llama-3-8B
        int8 = KVPool.bytes_per_token(layers, heads, head_dim, torch.int8)
        bf16 = KVPool.bytes_per_token(layers, heads, head_dim, torch.bfloat16)
        assert (1 << 30) // int8 >= 1.9 * ((1 << 30) // bf16)
    assert KVPool.bytes_per_token(30, 3, 64, torch.int8) == 30 * 3 * 2 * 66


def test_int8_resolves_and_an_unknown_name_is_refused() -> None:
    assert resolve_kv_cache_dtype("int8", torch.bfloat16) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


@needs_paged
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_reads_the_8bit_pool_as_its_dequantized_values(page_size: int, q_dtype: torch.dtype) -> None:
    """Decode rows, short extends and a shared prefix (cascade) in one call, on 1 and 2 threads (splits)."""
    contexts, lens, num_slots = layout(page_size, seed=page_size)
    pool = int8_pool(num_slots)
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    expected = reference(q, *dequantized(pool), contexts, lens)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            got = paged_attention(q, pool.k[0], pool.v[0], PagedIndex.build(contexts, lens), scales=scales(pool))
        finally:
            torch.set_num_threads(1)
        # q quantized to int8 (measured <= 4.0e-3 on these random rows: softmaxes far sharper than a model's)
        assert_close(got, expected, Q_INT8_TOLERANCE)


@needs_paged
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_cascade_and_other_head_dims_read_the_8bit_pool(head_dim: int) -> None:
    contexts, lens, num_slots = cascade_layout(16, seed=0)
    pool = int8_pool(num_slots, head_dim=head_dim, seed=head_dim)
    q = torch.randn(sum(lens), HEADS, head_dim, generator=torch.Generator().manual_seed(2))
    index = PagedIndex.build(contexts, lens)
    assert index.shared.lens.size >= 2  # the shared-prefix pass runs
    got = paged_attention(q, pool.k[0], pool.v[0], index, scales=scales(pool))
    assert_close(got, reference(q, *dequantized(pool), contexts, lens), Q_INT8_TOLERANCE)  # measured <= 1.2e-2


@needs_paged
@pytest.mark.parametrize("head_dim", [64, 128])
def test_an_8bit_row_has_the_same_bits_wherever_its_extend_starts(head_dim: int) -> None:
    """The paged kernel's integer value pass (weights quantized per 16-key block, int32 sums, one float FMA a
    block in position order): an extend of 40 rows over a 560-token prefix (past one 2 x 256-key stream block),
    cut in pieces and as single decode rows, gives each row the same bits as the whole extend."""
    pool = int8_pool(700, head_dim=head_dim, seed=5)
    slots = torch.randperm(699, generator=torch.Generator().manual_seed(5))[:600] + 1
    q = torch.randn(40, HEADS, head_dim, generator=torch.Generator().manual_seed(6))

    def run(start: int, stop: int) -> torch.Tensor:
        index = PagedIndex.build([slots[: 560 + stop]], [stop - start], cascade=False)
        return paged_attention(q[start:stop], pool.k[0], pool.v[0], index, scales=scales(pool))

    whole = run(0, 40)
    assert_close(whole, reference(q, *dequantized(pool), [slots], [40]), Q_INT8_TOLERANCE)  # measured <= 1.5e-2
    for cuts in ([0, 13, 40], [0, 5, 21, 22, 40], list(range(41))):
        assert torch.equal(torch.cat([run(a, b) for a, b in zip(cuts, cuts[1:])]), whole)


@needs_paged
@pytest.mark.parametrize("head_dim", [64, 128])
def test_8bit_scores_of_int8_exact_rows_lose_nothing(head_dim: int) -> None:
    """Query rows that are int8 codes times one factor (each row's largest exactly 127 of them) pass the scores
    pass's int8 quantization unchanged: q . code is then exact in int32 (vpdpbusd on codes + 128, less 128 x the
    row's code sum), so the kernel meets dequantized SDPA as closely as the int16 weights allow, on decode rows,
    extend tiles, scattered pages and contexts ending anywhere in a 16-key block."""
    contexts, lens, num_slots = layout(16, seed=9)
    pool = int8_pool(num_slots, head_dim=head_dim, seed=9)
    generator = torch.Generator().manual_seed(9)
    codes = torch.randint(-127, 128, (sum(lens), HEADS, head_dim), generator=generator)
    codes[..., 3] = 127
    q = codes.float() * (torch.rand(sum(lens), HEADS, 1, generator=generator) + 0.1)
    got = paged_attention(q, pool.k[0], pool.v[0], PagedIndex.build(contexts, lens, cascade=False), scales=scales(pool))
    assert_close(got, reference(q, *dequantized(pool), contexts, lens), 1e-4)


@needs_paged
def test_the_kernels_refuse_an_8bit_pool_without_its_scales() -> None:
    pool = int8_pool(64)
    q = torch.randn(1, HEADS, HEAD_DIM)
    index = PagedIndex.build([torch.arange(1, 9)], [1])
    with pytest.raises(RuntimeError, match="needs its scales"):
        paged_attention(q, pool.k[0], pool.v[0], index)


@needs_extend
@pytest.mark.parametrize("seed", range(2))
def test_extend_kernel_reads_the_8bit_pool_as_bf16_dequantized_values(seed: int) -> None:
    contexts, lens, num_slots = random_layout(16, seed)
    pool = int8_pool(num_slots, kv_heads=3, seed=seed)
    q = torch.randn(sum(lens), 9, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    got = extend_attention(
        q, pool.k[0], pool.v[0], PagedIndex.build(contexts, lens, cascade=False), scales=scales(pool)
    )
    k, v = (x.to(torch.bfloat16) for x in dequantized(pool))  # what the kernel packs
    assert_close(got, reference(q, k, v, contexts, lens), 8e-3)  # P rounded to bf16, as the bf16 pool's


@needs_extend
def test_8bit_extend_chunks_and_cached_prefixes_give_the_bits_of_the_whole_prompt() -> None:
    pool = int8_pool(400, kv_heads=3)
    q = torch.randn(300, 9, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    slots = torch.randperm(399, generator=torch.Generator().manual_seed(4))[:300] + 1
    whole = extend_attention(q, pool.k[0], pool.v[0], PagedIndex.build([slots], [300], False), scales=scales(pool))
    for cuts in ([128, 172], [47, 81, 172]):
        start, parts = 0, []
        for n in cuts:
            index = PagedIndex.build([slots[: start + n]], [n], False)
            parts.append(extend_attention(q[start : start + n], pool.k[0], pool.v[0], index, scales=scales(pool)))
            start += n
        assert torch.equal(torch.cat(parts), whole)


def test_the_reference_backend_reads_the_8bit_pool_close_to_the_kernels(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """float32 weights: gather + SDPA on the dequantized context vs the paged kernel, one decode step."""
    folder = tmp_path_factory.mktemp("ref-int8")
    build_hf_model("llama", folder)
    logits = []
    for backend in ("reference", "paged" if paged_kernel.load() else "reference"):
        model = load_ours(folder, torch.float32, backend)
        pool, allocator = make_pool(model.config, dtype=torch.int8)
        prompt = list(range(3, 40))
        context = alloc(allocator, len(prompt))
        model(make_batch("extend", [(prompt, context)]), pool)
        logits.append(model(make_batch("decode", [([7], torch.cat([context, alloc(allocator, 1)]))]), pool))
    assert np.allclose(logits[0].numpy(), logits[1].numpy(), atol=1e-4)


@needs_paged
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(37, 9, 3, 64), (3, 8, 2, 128), (1, 2, 1, 16)])
@pytest.mark.parametrize("scale", [1.0, 3e-38, 1e38])
def test_the_fused_rotary_write_quantizes_as_the_pool_does(
    dtype: torch.dtype, rows: int, heads: int, kv_heads: int, dim: int, scale: float
) -> None:
    """csrc/fused_ops.cpp's rotary + write into an 8-bit pool stores KVPool.write's codes and scales, bit for bit."""
    qkv, cos, sin, slots = _rotary_inputs(rows, heads, kv_heads, dim, dtype, seed=rows, scale=scale)
    fused_pool, torch_pool = (KVPool(2, 301, kv_heads, dim, torch.int8) for _ in range(2))
    q = fused_pool.write_rotated(1, slots, qkv, cos, sin, heads)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim), cos, sin)
    torch_pool.write(1, slots, qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim))
    assert torch.equal(q, qk[:, :heads])
    every = fused_pool.k + fused_pool.v + fused_pool.k_scale + fused_pool.v_scale
    assert all(
        torch.equal(a, b) for a, b in zip(every, torch_pool.k + torch_pool.v + torch_pool.k_scale + torch_pool.v_scale)
    )
