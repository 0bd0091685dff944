"""The bf16 extend kernel (AVX512-BF16) against float32 SDPA on the same bf16 inputs, on random paged layouts.

Layouts the engine produces: cold prefills, extends on a cached prefix, pages of
1 and 16 tokens, a fragmented pool, mixed lengths in one batch, lengths that are
not multiples of the kernel's tiles, chunked extends. Then what the kernel
promises beyond closeness: a prompt split into chunks, or a tail on a cached
prefix, gets the same bits as the whole prompt, on 1 or 2 threads; and so an
engine in bfloat16 gives the same greedy tokens on a cache hit as without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.memory.kv_pool import KVPool
from radixserve.model import attention
from radixserve.model.attention import Routes, extend_kernel_usable
from radixserve.model.forward import ForwardBatch
from radixserve.model.paged_kernel import PagedIndex, extend_attention
from tests.model.test_paged_attention import reference, slot_taker
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

needs_kernel = pytest.mark.skipif(
    not extend_kernel_usable(), reason="the CPU lacks AVX512-BF16 (or no compiler): bf16 extends use gather + SDPA"
)
# bf16 output (half a step near 1: 2e-3) after P is rounded to bf16 as SDPA's bf16 kernel does.
TOLERANCE = 2e-2


def random_layout(page_size: int, seed: int) -> tuple[list[torch.Tensor], list[int], int]:
    """Contexts and extend lengths of one batch: cold prefills and extends on cached prefixes, odd lengths."""
    rng = np.random.default_rng(seed)
    take = slot_taker(8192, page_size, rng)

    contexts, lens = [], []
    for _ in range(int(rng.integers(1, 5))):
        extend_len = int(rng.choice([1, 2, 5, 47, 128, 130, 301]))
        prefix_len = int(rng.choice([0, 0, 1, 63, 200, 777]))  # 0: a cold prefill
        contexts.append(torch.cat([take(prefix_len), take(extend_len)]) if prefix_len else take(extend_len))
        lens.append(extend_len)
    return contexts, lens, 8192 + page_size


def run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contexts: list[torch.Tensor], lens: list[int]
) -> torch.Tensor:
    return extend_attention(q, k, v, PagedIndex.build(contexts, lens, cascade=False))


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 64), (4, 1, 128), (4, 2, 16), (6, 3, 32)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_extend_kernel_equals_float32_sdpa(heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int) -> None:
    contexts, lens, num_slots = random_layout(page_size, seed)
    generator = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, kv_heads, num_slots, head_dim, generator=generator).to(torch.bfloat16)
    q = torch.randn(sum(lens), heads, head_dim, generator=generator).to(torch.bfloat16)
    got = run(q, k, v, contexts, lens)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert (got.float() - reference(q, k, v, contexts, lens)).abs().max().item() <= TOLERANCE


@needs_kernel
@pytest.mark.parametrize("cuts", [[300], [1, 299], [128, 172], [47, 81, 172], [200, 99, 1]])
def test_chunks_and_cached_prefixes_give_the_same_bits_as_the_whole_prompt(cuts: list[int]) -> None:
    """Chunk by chunk, each on the chunks before it (cached), as chunked prefill and cache hits do."""
    generator = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 3, 1024, 64, generator=generator).to(torch.bfloat16)
    q = torch.randn(300, 9, 64, generator=generator).to(torch.bfloat16)
    slots = torch.randperm(1023, generator=generator)[:300] + 1
    whole = run(q, k, v, [slots], [300])
    chunks, done = [], 0
    for cut in cuts:
        chunks.append(run(q[done : done + cut], k, v, [slots[: done + cut]], [cut]))
        done += cut
    assert torch.equal(torch.cat(chunks), whole)
    torch.set_num_threads(2)
    try:  # 2 threads take the work items in another order: same bits
        batch = run(torch.cat([q, q[100:]]), k, v, [slots, slots], [300, 200])
    finally:
        torch.set_num_threads(1)
    assert torch.equal(batch[:300], whole) and torch.equal(batch[300:], whole[100:])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (7, 1), (5, 5)])
def test_a_sharp_softmax_over_odd_row_counts_stays_close_and_chunk_invariant(heads: int, kv_heads: int) -> None:
    """q 40x larger: most of a row's exps fall below 2^-126 (the exp's underflow, where P must still be 0 and l
    untouched); GQA groups of 7, 5 and 1 give work items whose rows do not fill the softmax's groups of 16."""
    generator = torch.Generator().manual_seed(11)
    k, v = torch.randn(2, kv_heads, 1024, 64, generator=generator).to(torch.bfloat16)
    q = (40 * torch.randn(300, heads, 64, generator=generator)).to(torch.bfloat16)
    slots = torch.randperm(1023, generator=generator)[:300] + 1
    whole = run(q, k, v, [slots], [300])
    assert (whole.float() - reference(q, k, v, [slots], [300])).abs().max().item() <= TOLERANCE
    chunks = [run(q[:131], k, v, [slots[:131]], [131]), run(q[131:], k, v, [slots], [169])]
    assert torch.equal(torch.cat(chunks), whole)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_keys_in_consecutive_slots_pack_as_scattered_ones(head_dim: int) -> None:
    """16 keys in consecutive slots are packed by a transposition, others by gathers: the same K/V at consecutive
    slots (a cold prefill), in runs of 23 and scattered give the same bits (head dim 48: gathers only)."""
    generator = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, 701, head_dim, generator=generator).to(torch.bfloat16)
    q = torch.randn(300, 9, head_dim, generator=generator).to(torch.bfloat16)
    consecutive = torch.arange(1, 301)
    runs = torch.cat([torch.arange(400 - 30 * i, 423 - 30 * i) for i in range(14)])[:300]
    scattered = torch.randperm(700, generator=generator)[:300] + 1
    outputs = []
    for slots in (consecutive, runs, scattered):
        k_at, v_at = torch.zeros_like(k), torch.zeros_like(v)
        k_at[:, slots], v_at[:, slots] = k[:, 1:301], v[:, 1:301]
        outputs.append(run(q, k_at, v_at, [slots], [300]))
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[2])
    assert (outputs[0].float() - reference(q, k, v, [consecutive], [300])).abs().max().item() <= TOLERANCE


@needs_kernel
def test_extend_kernel_rejects_indices_that_do_not_cover_the_batch() -> None:
    k = v = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="do not cover"):
        run(q, k, v, [torch.tensor([1, 2])], [2])  # two rows, but q has three
    with pytest.raises(RuntimeError, match="outside the pool"):
        run(q, k, v, [torch.tensor([1, 2, 9])], [3])


def test_the_extend_kernel_takes_every_prefill_chunk_but_not_the_decodes_of_a_mixed_step() -> None:
    slots = [torch.arange(1, 11), torch.arange(11, 14), torch.arange(14, 20)]

    def routes(mode: str, lens: list[int], extend_kernel: bool) -> Routes:
        batch = ForwardBatch(
            mode, torch.zeros(sum(lens), dtype=torch.int64), torch.zeros(sum(lens)), torch.zeros(sum(lens)), slots, lens
        )  # type: ignore[arg-type]
        return Routes.build(batch, "paged", True, extend_kernel)

    mixed = routes("mixed", [10, 1, 1], True)
    assert mixed.extend is not None and mixed.extend.q_starts.tolist() == [0, 10]
    assert mixed.paged is not None and mixed.paged_rows is not None and mixed.paged_rows.tolist() == [10, 11]
    extend = routes("extend", [10, 1, 6], True)  # a hit's one-token tail too: same kernel as its cold prefill
    assert extend.extend is not None and extend.extend_rows is None and extend.paged is None
    assert routes("decode", [1, 1, 1], True).extend is None
    without = routes("extend", [10, 1, 6], False)
    assert without.extend is None and len(without.spans) == 1 and without.paged is not None


@needs_kernel
@pytest.mark.parametrize("chunk,kv", [(8192, "auto"), (16, "auto"), (8192, "int8")])
def test_a_bfloat16_cache_hit_gives_the_same_tokens_as_a_cold_prefill(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, kv: str
) -> None:
    """Prompt prefilled whole (or in chunks of 16) vs its tail extended on a cached prefix, both through the kernel;
    on a bfloat16 pool and an 8-bit one (--kv-cache-dtype int8)."""
    calls: list[int] = []

    def spy(q: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(q.shape[0])
        return extend_attention(q, *args)

    monkeypatch.setattr(attention, "extend_attention", spy)
    engine = Engine.create(
        model_path=str(tiny_model_dir),
        max_total_tokens=2048,
        dtype="bfloat16",
        chunked_prefill_size=chunk,
        kv_cache_dtype=kv,
    )
    assert engine.describe()["resolved_kv_cache_dtype"] == ("int8" if kv == "int8" else "bfloat16")
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    generator = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 128, (40,), generator=generator).tolist()
    prompts = [shared + torch.randint(3, 128, (n,), generator=generator).tolist() for n in (1, 5, 20, 60)]
    cold = []
    for ids in prompts:
        engine.flush_cache()
        cold.append(engine.generate(input_ids=ids, sampling_params=greedy).output_ids)
    engine.flush_cache()
    engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 1})
    for ids, expected in zip(prompts, cold):
        hit = engine.generate(input_ids=ids, sampling_params=greedy)
        assert hit.cached_tokens >= 40 - 1
        assert hit.output_ids == expected
    assert calls and max(calls) <= chunk
    engine.check_idle_invariants()


@needs_kernel
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.int8])
def test_a_bfloat16_mixed_step_gives_the_same_bits_as_its_extend_and_decode_steps_apart(
    tmp_path_factory: pytest.TempPathFactory, pool_dtype: torch.dtype
) -> None:
    """Prefill chunks (kernel) next to decodes (paged kernel) in one forward, as ``--enable-mixed-chunk`` runs them,
    on a bfloat16 pool and an 8-bit one (--kv-cache-dtype int8)."""
    folder = tmp_path_factory.mktemp("mixed-bf16")
    build_hf_model("llama", folder)
    model = load_ours(folder, torch.bfloat16)

    def setup() -> tuple[KVPool, list[tuple[list[int], torch.Tensor]]]:
        pool, allocator = make_pool(model.config, dtype=pool_dtype)
        prompts = [list(range(3, 14)), list(range(20, 25)), list(range(40, 49))]
        contexts = [alloc(allocator, len(p)).flip(0) for p in prompts]
        model(make_batch("extend", list(zip(prompts, contexts))), pool)
        decode_a = ([17], torch.cat([contexts[0], alloc(allocator, 1)]))
        decode_b = ([23], torch.cat([contexts[1], alloc(allocator, 1)]))
        chunk = (list(range(60, 80)), torch.cat([contexts[2], alloc(allocator, 20)]))
        short = ([5, 6, 7], alloc(allocator, 3))
        return pool, [chunk, decode_a, short, decode_b]

    pool, items = setup()
    mixed = model(make_batch("mixed", items), pool)
    pool, items = setup()
    extend = model(make_batch("extend", [items[0], items[2]]), pool)
    decode = model(make_batch("decode", [items[1], items[3]]), pool)
    assert torch.equal(mixed, torch.stack([extend[0], decode[0], extend[1], decode[1]]))
