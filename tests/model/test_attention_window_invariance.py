"""A window and a soft cap keep what the kernels promise about bits, and the window is transformers' own.

The extend kernel: a prompt whole, in chunks, or as a tail on a cached prefix gets the same bits (now
with windows that start inside, at and across its 128-key tiles). The paged kernel: a decode row's bits
do not depend on its companions in the step (a split context, a shared prefix read once or, in a
windowed layer whose contexts outgrow the window, per member). The model: a bf16 mixed step equals its
extend and decode steps apart, and a cache hit's tail equals the cold prefill, with Gemma-like layers
(windowed and soft-capped ones alternating with global ones); and a Mistral with a sliding window
gives transformers' logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve.model import paged_kernel
from radixserve.model.attention import extend_kernel_usable
from radixserve.model.attention_params import AttentionParams
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.paged_kernel import PagedIndex, extend_attention, paged_attention
from tests.model.test_paged_attention import slot_taker
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

needs_extend = pytest.mark.skipif(not extend_kernel_usable(), reason="the CPU lacks AVX512-BF16 (or no compiler)")
needs_kernel = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the paged kernel cannot build")
WINDOWED = [AttentionParams(window=w, softcap=c) for w, c in ((100, 0.0), (128, 0.0), (200, 5.0), (37, 0.0))]
WINDOWED += [AttentionParams(softcap=3.0, scale=0.1)]


@needs_extend
@pytest.mark.parametrize("params", WINDOWED, ids=str)
@pytest.mark.parametrize("cuts", [[300], [1, 299], [128, 172], [47, 81, 172], [200, 99, 1]])
def test_extend_chunks_and_cached_prefixes_give_the_same_bits_with_a_window(
    params: AttentionParams, cuts: list[int]
) -> None:
    generator = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 3, 1024, 64, generator=generator).to(torch.bfloat16)
    q = torch.randn(300, 9, 64, generator=generator).to(torch.bfloat16)
    slots = torch.randperm(1023, generator=generator)[:300] + 1

    def run(rows: torch.Tensor, contexts: list[torch.Tensor], lens: list[int]) -> torch.Tensor:
        return extend_attention(rows, k, v, PagedIndex.build(contexts, lens, cascade=False), params)

    whole = run(q, [slots], [300])
    chunks, done = [], 0
    for cut in cuts:
        chunks.append(run(q[done : done + cut], [slots[: done + cut]], [cut]))
        done += cut
    assert torch.equal(torch.cat(chunks), whole)
    torch.set_num_threads(2)
    try:  # 2 threads take the work items in another order; a companion request in the batch
        batch = run(torch.cat([q, q[100:]]), [slots, slots], [300, 200])
    finally:
        torch.set_num_threads(1)
    assert torch.equal(batch[:300], whole) and torch.equal(batch[300:], whole[100:])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [*WINDOWED, AttentionParams(window=2000)], ids=str)
def test_a_decode_rows_bits_do_not_depend_on_its_companions(dtype: torch.dtype, params: AttentionParams) -> None:
    """Decodes on their own, then next to a context split among items and next to a group on a shared
    prefix (read once where every member's context fits the window, per member otherwise): each row is
    one partial, written by its item or through the merge, the same bits."""
    rng = np.random.default_rng(7)
    take = slot_taker(8192, 1, rng)
    own = [
        torch.cat([take(n), take(1)]) for n in (10, 99, 100, 101, 250)
    ]  # around and past the windows; < 256: not split
    generator = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 2, 8192 + 1, 64, generator=generator).to(dtype)
    q = torch.randn(len(own) + 3, 6, 64, generator=generator).to(dtype)
    rows = len(own)
    alone = paged_attention(
        q[:rows], k, v, dataclasses.replace(PagedIndex.build(own, [1] * rows), num_splits=1), params
    )
    split = dataclasses.replace(
        PagedIndex.build([*own, torch.cat([take(3000), take(1)])], [1] * (rows + 1)), num_splits=4
    )
    shared = take(300)
    sharers = [torch.cat([shared, take(1)]), torch.cat([shared, take(2)])]
    with_split = paged_attention(q[: rows + 1], k, v, split, params)
    with_shared = paged_attention(q, k, v, PagedIndex.build([*own, *sharers], [1] * rows + [1, 2]), params)
    assert torch.equal(with_split[:rows], alone) and torch.equal(with_shared[:rows], alone)


def gemma_like(model: LlamaForCausalLM, window: int) -> LlamaForCausalLM:
    """Layers alternating windowed + soft-capped (local) and global, with another scale, as Gemma 2's."""
    for i, layer in enumerate(model.layers):
        local = AttentionParams(window=window, softcap=2.0, scale=0.2)
        layer.self_attn.params = local if i % 2 == 0 else AttentionParams(scale=0.2)
    return model


@needs_extend
def test_a_bfloat16_windowed_mixed_step_and_cache_hit_give_the_bits_of_their_steps_apart(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Prefill chunks (extend kernel) next to decodes (paged kernel) in one forward, against the same apart;
    and a prompt prefilled whole against its tail on its own cached prefix (as a cache hit runs it)."""
    folder = tmp_path_factory.mktemp("window-bf16")
    build_hf_model("llama", folder)
    model = gemma_like(load_ours(folder, torch.bfloat16), window=7)
    ids = torch.randint(3, 128, (80,), generator=torch.Generator().manual_seed(3)).tolist()

    def setup() -> tuple[object, list[tuple[list[int], torch.Tensor]]]:
        pool, allocator = make_pool(model.config, dtype=torch.bfloat16)
        prompts = [ids[:11], ids[20:25], ids[40:49]]
        contexts = [alloc(allocator, len(p)).flip(0) for p in prompts]
        model(make_batch("extend", list(zip(prompts, contexts))), pool)
        decode_a = ([17], torch.cat([contexts[0], alloc(allocator, 1)]))
        decode_b = ([23], torch.cat([contexts[1], alloc(allocator, 1)]))
        chunk = (ids[60:80], torch.cat([contexts[2], alloc(allocator, 20)]))
        return pool, [chunk, decode_a, ([5, 6, 7], alloc(allocator, 3)), decode_b]

    pool, items = setup()
    mixed = model(make_batch("mixed", items), pool)
    pool, items = setup()
    extend = model(make_batch("extend", [items[0], items[2]]), pool)
    decode = model(make_batch("decode", [items[1], items[3]]), pool)
    assert torch.equal(mixed, torch.stack([extend[0], decode[0], extend[1], decode[1]]))

    pool, allocator = make_pool(model.config, dtype=torch.bfloat16)
    slots = alloc(allocator, 80)
    cold = model(make_batch("extend", [(ids, slots)]), pool, return_all_logits=True)
    for cut in (1, 7, 30, 79):  # the tail on a cached prefix; the prefix's K/V as the cold run wrote it
        hit = model(make_batch("extend", [(ids[cut:], slots)]), pool, return_all_logits=True)
        assert torch.equal(hit[-1], cold[-1])


@pytest.mark.parametrize("backend", ["reference", pytest.param("paged", marks=needs_kernel)])
def test_a_sliding_window_mistral_gives_transformers_logits(tmp_path: Path, backend: str) -> None:
    """transformers' own Mistral with sliding_window 16 on a 60-token prompt, and 8 decode steps after it: our
    layers given window 16 here (the weights saved without one, so the window is this test's alone; 15 or 17
    is off by ~2 in the logits)."""
    hf_model = build_hf_model("mistral", tmp_path / "hf", sliding_window=16)
    build_hf_model("mistral", tmp_path / "ours")  # the same seed: the same weights
    model = load_ours(tmp_path / "ours")
    model.attention_backend = backend
    for layer in model.layers:
        layer.self_attn.params = AttentionParams(window=16)
    ids = torch.randint(0, 128, (68,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    pool, allocator = make_pool(model.config)
    context = alloc(allocator, 60)
    got = [model(make_batch("extend", [(ids[:60], context)]), pool, return_all_logits=True)]
    for token in ids[60:]:
        context = torch.cat([context, alloc(allocator, 1)])
        got.append(model(make_batch("decode", [([token], context)]), pool))
    assert (torch.cat(got) - expected).abs().max().item() <= 1e-4
