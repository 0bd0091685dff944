"""The fused CPU kernels (csrc/fused_ops.cpp) against the torch ops they replace, bit for bit.

RMSNorm, SwiGLU and rotary + the K/V write each promise the torch path's bits (layers.py,
attention.py, KVPool.write): float32 and bfloat16, odd row counts and widths (torch's vector
tails), several head layouts, a pool of either dtype. Then what that buys through the model: with
the kernels on, the logits equal the torch path's, and a prompt prefilled whole, in chunks, or as a
tail on a cached prefix gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F

from radixserve.memory.kv_pool import KVPool
from radixserve.model import layers
from radixserve.model.attention import extend_kernel_usable
from radixserve.model.layers import RMSNorm, apply_rotary, fused_ops_built, swiglu
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

pytestmark = pytest.mark.skipif(not fused_ops_built(), reason="no C++ compiler: the torch ops run")
DTYPES = [torch.float32, torch.bfloat16]
T = TypeVar("T")


def _with_torch_ops(fn: Callable[[], T]) -> T:
    """fn() on the torch path (the reference), on one thread: torch's silu splits rows between threads
    at any element, so its row tails (std::exp), and with them a bit here and there, follow the thread
    count. Then the fused path again."""
    threads = torch.get_num_threads()
    layers.USE_FUSED_OPS, before = False, layers.USE_FUSED_OPS
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        layers.USE_FUSED_OPS = before
        torch.set_num_threads(threads)


def _norm(dim: int, dtype: torch.dtype, generator: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, torch.device("cpu"), dtype)
    norm.weight.data = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (33, 100), (5, 7), (3, 4100), (2, 70000)])
def test_rms_norm_gives_the_torch_ops_bits(dtype: torch.dtype, rows: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rows * dim)
    norm = _norm(dim, dtype, generator)
    x = (3 * torch.randn(rows, dim, generator=generator)).to(dtype)
    fused = norm(x)
    assert fused.dtype == dtype and torch.equal(fused, _with_torch_ops(lambda: norm(x)))
    # transformers' LlamaRMSNorm, literally: float32 weights must keep matching it.
    x32 = x.float()
    hf = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
    assert torch.equal(fused, hf)
    assert torch.equal(norm(x.view(rows, 1, dim)), fused.view(rows, 1, dim))  # any leading shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 128), (4, 48), (3, 100), (2, 17), (5, 96)])
def test_swiglu_gives_the_torch_ops_bits(dtype: torch.dtype, rows: int, inter: int) -> None:
    """Widths that are not multiples of torch's vector chunk (64 bf16 / 32 floats under AVX512): the
    tail of each row goes through std::exp in torch's silu, and in the kernel."""
    generator = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=generator)).to(dtype)
    fused = swiglu(gate_up)
    gate, up = torch.split(gate_up, inter, dim=-1)
    assert fused.shape == (rows, inter) and torch.equal(fused, _with_torch_ops(lambda: F.silu(gate).mul_(up)))
    assert torch.equal(_with_torch_ops(lambda: swiglu(gate_up)), fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_keeps_subnormal_results_as_torch_does(dtype: torch.dtype) -> None:
    """Tiny gates (silu subnormal) and products under 2^-126: the kernel's fast bf16 rounding
    (vcvtne2ps2bf16) flushes subnormals, so those chunks take the integer rounding torch uses."""
    generator = torch.Generator().manual_seed(7)
    gate = torch.cat([torch.randn(4, 256, generator=generator) * 1e-39, torch.randn(4, 256, generator=generator)])
    up = torch.cat([torch.randn(4, 256, generator=generator), torch.randn(4, 256, generator=generator) * 1e-37])
    gate_up = torch.cat([gate, up], dim=-1).to(dtype)
    expected = _with_torch_ops(lambda: swiglu(gate_up))
    subnormal = (expected != 0) & (expected.float().abs() < torch.finfo(torch.float32).tiny)
    assert subnormal.sum() > 100 and torch.equal(swiglu(gate_up), expected)


def _rotary_inputs(
    rows: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    qkv = (scale * torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator)).to(dtype)
    angles = 100 * torch.rand(rows, dim // 2, generator=generator)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    slots = torch.randperm(300, generator=generator)[:rows] + 1
    return qkv, cos, sin, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(37, 9, 3, 64), (5, 4, 4, 32), (3, 8, 2, 128), (1, 2, 1, 16)])
@pytest.mark.parametrize("scale", [1.0, 3e-38, 1e38])  # products and sums subnormal; past float32's range
def test_rotary_kv_write_gives_the_torch_ops_bits(
    dtype: torch.dtype, pool_dtype: torch.dtype, rows: int, heads: int, kv_heads: int, dim: int, scale: float
) -> None:
    """bfloat16 heads of a multiple of 32 dims run the AVX512 loop, the others (and float32) the scalar one."""
    qkv, cos, sin, slots = _rotary_inputs(rows, heads, kv_heads, dim, dtype, seed=rows * heads, scale=scale)
    fused_pool, torch_pool = (KVPool(2, 301, kv_heads, dim, dtype=pool_dtype) for _ in range(2))
    for pool in (fused_pool, torch_pool):  # slots not written must stay as they were
        pool.k[1].normal_(generator=torch.Generator().manual_seed(1))
        pool.v[1].normal_(generator=torch.Generator().manual_seed(2))
    q = fused_pool.write_rotated(1, slots, qkv, cos, sin, heads)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim), cos, sin)
    torch_pool.write(1, slots, qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim))
    assert q.shape == (rows, heads, dim) and q.is_contiguous() and torch.equal(q, qk[:, :heads])
    assert all(torch.equal(a, b) for a, b in zip(fused_pool.k + fused_pool.v, torch_pool.k + torch_pool.v))


def test_rotary_kv_write_refuses_a_slot_outside_the_pool() -> None:
    qkv, cos, sin, slots = _rotary_inputs(4, 2, 1, 16, torch.float32, seed=0)
    pool = KVPool(1, 301, 1, 16)
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        pool.write_rotated(0, torch.tensor([1, 2, 301, 3]), qkv, cos, sin, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_depend_on_that_row_alone(dtype: torch.dtype) -> None:
    """1 or 2 threads, alone or in a batch of 300: the same bits (what cache-hit invariance rests on)."""
    generator = torch.Generator().manual_seed(0)
    norm = _norm(576, dtype, generator)
    x = torch.randn(300, 576, generator=generator).to(dtype)
    gate_up = torch.randn(300, 2 * 1536, generator=generator).to(dtype)
    qkv, cos, sin, slots = _rotary_inputs(300, 9, 3, 64, dtype, seed=3)
    threads = torch.get_num_threads()
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        pool = KVPool(1, 301, 3, 64, dtype=dtype)
        results.append((norm(x), swiglu(gate_up), pool.write_rotated(0, slots, qkv, cos, sin, 9), pool.k[0].clone()))
    torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    row = 123
    norm_all, swiglu_all, q_all, _ = results[0]
    pool = KVPool(1, 301, 3, 64, dtype=dtype)
    q_row = pool.write_rotated(0, slots[row : row + 1], qkv[row : row + 1], cos[row : row + 1], sin[row : row + 1], 9)
    assert torch.equal(norm(x[row : row + 1]), norm_all[row : row + 1])
    assert torch.equal(swiglu(gate_up[row : row + 1]), swiglu_all[row : row + 1])
    assert torch.equal(q_row, q_all[row : row + 1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fused-llama")
    build_hf_model("llama", path)
    return path


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_with_the_kernels_gives_the_torch_paths_logits(folder: Path, dtype: torch.dtype) -> None:
    """A prefill then a decode step, fused ops on and off: the same bits (and so float32 still equals
    transformers as closely as before, test_llama.py)."""
    model = load_ours(folder, dtype)
    prompt = torch.randint(3, 128, (29,), generator=torch.Generator().manual_seed(5)).tolist()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        pool, allocator = make_pool(model.config, dtype=dtype)
        context = alloc(allocator, len(prompt))
        prefill = model(make_batch("extend", [(prompt, context)]), pool, return_all_logits=True)
        decode = model(make_batch("decode", [([7], torch.cat([context, alloc(allocator, 1)]))]), pool)
        return prefill, decode

    fused = run()
    reference = _with_torch_ops(run)
    assert torch.equal(fused[0], reference[0]) and torch.equal(fused[1], reference[1])


@pytest.mark.skipif(
    not extend_kernel_usable(), reason="bf16 extends get the same bits at any length on the extend kernel only"
)
def test_whole_chunked_and_cache_hit_prefills_give_the_same_bits_with_the_kernels(folder: Path) -> None:
    model = load_ours(folder, torch.bfloat16)
    prompt = torch.randint(3, 128, (45,), generator=torch.Generator().manual_seed(6)).tolist()

    def prefill(cuts: list[int]) -> torch.Tensor:
        """Logits of every position, the prompt run as pieces ending at ``cuts``, each on the ones before."""
        pool, allocator = make_pool(model.config, dtype=torch.bfloat16)
        context, rows, start = torch.zeros(0, dtype=torch.int64), [], 0
        for end in cuts:
            context = torch.cat([context, alloc(allocator, end - start)])
            rows.append(model(make_batch("extend", [(prompt[start:end], context)]), pool, return_all_logits=True))
            start = end
        return torch.cat(rows)

    whole = prefill([45])
    assert torch.equal(prefill([16, 32, 45]), whole)  # chunked prefill
    assert torch.equal(prefill([40, 45]), whole)  # a cache hit's tail on a 40-token prefix
    assert torch.equal(prefill([44, 45]), whole)  # a one-token tail
