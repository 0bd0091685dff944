"""The last layer of a step that returns only each request's last-row logits runs its attention, o_proj and
MLP for a tail of rows (attention.tail_lens, ForwardBatch.tail): the same logits as computing every row, with
every row's K/V still written to the pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.model.attention import PAGED_MAX_EXTEND_LEN, TAIL_MIN_ROWS, extend_kernel_usable, tail_lens
from radixserve.model.llama import LlamaForCausalLM
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool


def test_tail_lens_keep_the_step_tail_each_last_row_and_every_route() -> None:
    assert tail_lens([TAIL_MIN_ROWS]) is None and tail_lens([30, 1, 33]) is None  # nothing to leave out
    assert tail_lens([2048]) == [TAIL_MIN_ROWS]
    # a decode (1 row) and a short extend keep all their rows, a long one at least one more than a short one
    # may have, and the rows in the step's last TAIL_MIN_ROWS stay
    lens = [500, 1, 5, 20, 300, 40]
    kept = tail_lens(lens)
    assert kept == [PAGED_MAX_EXTEND_LEN + 1, 1, 5, PAGED_MAX_EXTEND_LEN + 1, TAIL_MIN_ROWS - 40, 40]
    assert tail_lens([100, 100]) == [PAGED_MAX_EXTEND_LEN + 1, TAIL_MIN_ROWS]
    assert tail_lens([200, 3, 4, 100]) == [PAGED_MAX_EXTEND_LEN + 1, 3, 4, TAIL_MIN_ROWS]
    assert tail_lens([100, 3, 4]) == [TAIL_MIN_ROWS - 7, 3, 4]
    assert tail_lens([60, 10]) == [54, 10]
    assert tail_lens([5] * 20) is None  # the tail would be every row


def test_a_tail_batch_is_each_requests_last_rows_on_its_whole_context() -> None:
    items = [
        (list(range(10, 30)), torch.arange(100, 120)),
        ([7], torch.arange(1, 6)),
        ([1, 2, 3], torch.arange(40, 43)),
    ]
    batch = make_batch("mixed", items)
    tail, rows = batch.tail([4, 1, 2])
    assert rows.tolist() == [16, 17, 18, 19, 20, 22, 23]
    assert tail.extend_lens == [4, 1, 2] and tail.mode == "mixed"
    assert tail.input_ids.tolist() == [26, 27, 28, 29, 7, 2, 3]
    assert tail.positions.tolist() == [16, 17, 18, 19, 4, 1, 2]
    assert tail.out_slots.tolist() == [116, 117, 118, 119, 5, 41, 42]
    assert all(a is b for a, b in zip(tail.context_slots, batch.context_slots))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tail")
    build_hf_model("llama", folder)
    return folder


def logits_and_pool(model: LlamaForCausalLM, dtype: torch.dtype, all_logits: bool) -> tuple[torch.Tensor, ...]:
    """An extend step of a cold prefill, an extend on a cached prefix and two short ones (one cut by the tail)."""
    pool, allocator = make_pool(model.config, size=1024, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    prefix = alloc(allocator, 37).flip(0)
    model(make_batch("extend", [(torch.randint(3, 128, (37,), generator=generator).tolist(), prefix)]), pool)
    lens = [150, 70, 6, 20]
    contexts = [
        alloc(allocator, 150),
        torch.cat([prefix, alloc(allocator, 70)]),
        alloc(allocator, 6),
        alloc(allocator, 20),
    ]
    items = [(torch.randint(3, 128, (n,), generator=generator).tolist(), c) for n, c in zip(lens, contexts)]
    logits = model(make_batch("extend", items), pool, return_all_logits=all_logits)
    if all_logits:
        logits = logits[torch.tensor([150, 220, 226, 246]) - 1]
    return logits, torch.stack(list(pool.k)), torch.stack(list(pool.v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tail_gives_the_last_rows_logits_of_every_row_and_writes_every_kv(folder: Path, dtype: torch.dtype) -> None:
    """bfloat16 on the extend kernel: the same bits (a tail is an extend on a longer cached prefix, and its linears
    take the GEMMs all rows take); elsewhere (gather + SDPA over fewer rows) within float rounding."""
    model = load_ours(folder, dtype)
    tail, tail_k, tail_v = logits_and_pool(model, dtype, all_logits=False)
    whole, whole_k, whole_v = logits_and_pool(model, dtype, all_logits=True)
    assert torch.equal(tail_k, whole_k) and torch.equal(tail_v, whole_v)
    if dtype == torch.bfloat16 and extend_kernel_usable():
        assert torch.equal(tail, whole)
    else:
        torch.testing.assert_close(tail, whole, rtol=1e-4, atol=1e-4)
    assert tail.shape == (4, model.config.vocab_size)
