"""The in-place paged attention kernel against the reference gather + SDPA, on random paged layouts.

Layouts the engine produces: shared prefixes (two requests reading the same
slots), pages of 1 and 16 tokens, a fragmented pool (slots handed out after
churn, in no order), mixed context lengths in one batch, chunked extend on a
cached prefix, and decode rows next to extend rows in one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixserve.memory import TokenAllocator
from radixserve.model import paged_kernel
from radixserve.model.paged_kernel import PagedIndex, paged_attention

pytestmark = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the paged kernel cannot build")

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # bf16: the output's own rounding


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contexts: list[torch.Tensor], lens: list[int]
) -> torch.Tensor:
    """Per request: gather its context, causal mask shifted by its prefix, SDPA in float32."""
    out, start = [], 0
    for slots, extend_len in zip(contexts, lens):
        rows = q[start : start + extend_len].float().transpose(0, 1)[None]
        start += extend_len
        ctx = slots.shape[0]
        mask = torch.arange(ctx)[None, :] <= (torch.arange(extend_len) + ctx - extend_len)[:, None]
        kk, vv = k[:, slots].float()[None], v[:, slots].float()[None]
        out.append(F.scaled_dot_product_attention(rows, kk, vv, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def fragmented_allocator(size: int, page_size: int, rng: np.random.Generator) -> TokenAllocator:
    """An allocator whose free stack is shuffled by churn: later allocations are scattered."""
    allocator = TokenAllocator(size, page_size)
    held = [allocator.alloc(page_size * int(rng.integers(1, 4))) for _ in range(size // (3 * page_size))]
    for i in rng.permutation(len(held)):
        slots = held[i]
        assert slots is not None
        allocator.free(slots)
    return allocator


def slot_taker(size: int, page_size: int, rng: np.random.Generator) -> Callable[[int], torch.Tensor]:
    """``take(n)``: n slots of a fragmented pool, allocated in whole pages as a request's are."""
    allocator = fragmented_allocator(size, page_size, rng)

    def take(n: int) -> torch.Tensor:
        slots = allocator.alloc(-(-n // page_size) * page_size)
        assert slots is not None
        return torch.from_numpy(slots[:n])

    return take


def layout(page_size: int, seed: int) -> tuple[list[torch.Tensor], list[int], int]:
    """Contexts (slot lists) and extend lengths: a shared prefix, decode rows, chunked extends, odd lengths."""
    rng = np.random.default_rng(seed)
    take = slot_taker(4096, page_size, rng)

    shared = take(int(rng.integers(100, 700)))  # two requests share these slots, as a radix hit does
    contexts, lens = [], []
    for _ in range(int(rng.integers(3, 7))):
        extend_len = int(rng.choice([1, 1, 3, 8]))  # decode rows and extend chunks
        prefix = shared if rng.random() < 0.5 else take(int(rng.integers(0, 900)))
        contexts.append(torch.cat([prefix, take(extend_len)]))
        lens.append(extend_len)
    return contexts, lens, 4096 + page_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_paged_kernel_equals_gather_and_sdpa(dtype: torch.dtype, page_size: int, seed: int) -> None:
    contexts, lens, num_slots = layout(page_size, seed)
    generator = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, KV_HEADS, num_slots, HEAD_DIM, generator=generator).to(dtype)
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator).to(dtype)
    expected = reference(q, k, v, contexts, lens)
    for threads in (1, 2):  # 2 threads: decode contexts are split and merged
        torch.set_num_threads(threads)
        try:
            got = paged_attention(q, k, v, PagedIndex.build(contexts, lens))
        finally:
            torch.set_num_threads(1)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (10, 2, 64), (8, 2, 128), (6, 2, 48)])
def test_other_head_shapes_equal_gather_and_sdpa(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Groups of 1 and 5 rows (decode and extend tiles then fill row blocks of every size the vector
    loops have), head dim 128 (twice the registers a row) and 48 (the portable loops)."""
    contexts, lens, num_slots = layout(1, seed=4)  # extend lengths 1, 3 and 8
    generator = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, kv_heads, num_slots, head_dim, generator=generator).to(dtype)
    q = torch.randn(sum(lens), heads, head_dim, generator=generator).to(dtype)
    expected = reference(q, k, v, contexts, lens)
    got = paged_attention(q, k, v, PagedIndex.build(contexts, lens))
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_exact", [True, False])
def test_bfloat16_pool_with_float32_rows_is_float32_close(group: int, head_dim: int, q_exact: bool) -> None:
    """A bfloat16 pool read by float32 query rows, against float32 SDPA on the same values, to float32
    precision: the bfloat16 dot products (two keys a register, rows in blocks of up to 4, 8 keys a
    step) must lose nothing but q's own split into bfloat16 hi + lo. Groups 1-5 with extend tiles of 1,
    3 and 8 tokens give row blocks of every size and remainders; contexts end at any key of a block.
    q_exact: q representable in bfloat16 (the lo half is 0, as in a bfloat16 model), else not."""
    contexts, lens, num_slots = layout(1, seed=5)
    contexts.append(torch.arange(3000, 3000 + 13))  # 13 keys: a step of 8 and a tail of 5
    lens.append(1)
    generator = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 2, num_slots, head_dim, generator=generator).to(torch.bfloat16)
    q = torch.randn(sum(lens), 2 * group, head_dim, generator=generator)
    if q_exact:
        q = q.to(torch.bfloat16).float()
    expected = reference(q, k, v, contexts, lens)
    got = paged_attention(q, k, v, PagedIndex.build(contexts, lens))
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 2e-5  # measured <= 5e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_written_by_their_items_equal_the_merged_ones(dtype: torch.dtype) -> None:
    """Where every item reads its request's whole context, the items write their output rows
    themselves; next to a split context (flash-decoding) or a shared prefix every row goes through
    the merge instead. A request's rows must come out the same bits both ways, each row written."""
    rng = np.random.default_rng(7)
    take = slot_taker(4096, 1, rng)
    own = [torch.cat([take(100), take(1)]), torch.cat([take(50), take(3)]), take(13)]  # decode, extend, short
    own_lens = [1, 3, 1]
    long = torch.cat([take(1000), take(1)])  # split in 4 pieces of >= 256 keys when asked
    shared = take(300)
    sharers = [torch.cat([shared, take(1)]), torch.cat([shared, take(2)])]
    generator = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, KV_HEADS, 4096 + 1, HEAD_DIM, generator=generator).to(dtype)
    rows = sum(own_lens)
    q = torch.randn(rows + 3, HEADS, HEAD_DIM, generator=generator).to(dtype)

    alone = paged_attention(q[:rows], k, v, dataclasses.replace(PagedIndex.build(own, own_lens), num_splits=1))
    assert (alone.float() - reference(q[:rows], k, v, own, own_lens)).abs().max().item() <= TOLERANCE[dtype]
    split = dataclasses.replace(PagedIndex.build([*own, long], [*own_lens, 1]), num_splits=4)
    with_split = paged_attention(q[: rows + 1], k, v, split)
    with_shared = paged_attention(q, k, v, PagedIndex.build([*own, *sharers], [*own_lens, 1, 2]))
    assert with_shared.shape[0] == rows + 3
    assert torch.equal(with_split[:rows], alone)
    assert torch.equal(with_shared[:rows], alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_rows_are_the_float32_path_rounded(threads: int) -> None:
    """A bfloat16 q is read and its output rounded by the kernel itself (no conversion around the call): the same
    bits as the float32 path on the same q, rounded to bfloat16, with rows written by their items, merged after
    splits (2 threads) and next to a shared prefix (``layout``'s two requests share one)."""
    contexts, lens, num_slots = layout(16, seed=8)
    generator = torch.Generator().manual_seed(8)
    k, v = torch.randn(2, KV_HEADS, num_slots, HEAD_DIM, generator=generator).to(torch.bfloat16)
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    torch.set_num_threads(threads)
    try:
        for index in (PagedIndex.build(contexts, lens), PagedIndex.build(contexts, lens, cascade=False)):
            got = paged_attention(q, k, v, index)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, paged_attention(q.float(), k, v, index).to(torch.bfloat16))
    finally:
        torch.set_num_threads(1)


def test_paged_kernel_rejects_indices_that_do_not_cover_the_batch() -> None:
    k = v = torch.zeros(KV_HEADS, 8, HEAD_DIM)
    q = torch.zeros(2, HEADS, HEAD_DIM)
    index = PagedIndex.build([torch.tensor([1, 2])], [1])  # one row, but q has two
    with pytest.raises(RuntimeError, match="do not cover"):
        paged_attention(q, k, v, index)
