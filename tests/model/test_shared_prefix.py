"""Shared-prefix (cascade) attention: which requests are grouped, and the kernel against gather + SDPA.

Layouts as the radix tree makes them: several groups on prefixes of several lengths in
one batch (pages of 1 and 16, a fragmented pool), a prefix shorter than the threshold,
a member whose whole context is the shared prefix, extend rows on a shared prefix next
to decode rows, two documents under one system prompt; float32 and bfloat16 pools, one
and two threads (the shared pass is split over the prefix).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model import paged_kernel
from radixserve.model.paged_kernel import PagedIndex, paged_attention
from radixserve.model.shared_prefix import MIN_SHARED_PREFIX_LEN, find_shared_prefixes
from tests.model.test_paged_attention import HEAD_DIM, HEADS, KV_HEADS, TOLERANCE, reference, slot_taker

pytestmark = pytest.mark.skipif(not paged_kernel.load(), reason="no C++ compiler: the paged kernel cannot build")


def groups_of(contexts: list[torch.Tensor], lens: list[int]) -> list[tuple[list[int], int]]:
    found = PagedIndex.build(contexts, lens).shared
    return [(found.members[a:b].tolist(), int(n)) for a, b, n in zip(found.starts, found.starts[1:], found.lens)]


def test_requests_on_one_prefix_form_one_group_with_its_length() -> None:
    prefix = torch.arange(100, 300)
    contexts = [torch.cat([prefix, torch.tensor([900 + i])]) for i in range(3)] + [torch.arange(1000, 1201)]
    assert groups_of(contexts, [1, 1, 1, 1]) == [([0, 1, 2], 200)]


def test_a_prefix_below_the_threshold_is_not_grouped() -> None:
    short = torch.arange(MIN_SHARED_PREFIX_LEN - 1)
    contexts = [torch.cat([short, torch.arange(500, 600) + 200 * i]) for i in range(3)]
    assert groups_of(contexts, [1, 1, 1]) == []


def test_two_documents_under_one_system_prompt_form_two_groups() -> None:
    system = torch.arange(80)
    docs = [torch.arange(1000, 1300), torch.arange(2000, 2300)]
    contexts = [torch.cat([system, docs[i % 2], torch.tensor([5000 + i])]) for i in range(4)]
    # (1 member x 380 saved reads) per document beats (3 x 80) for the system prompt alone
    assert groups_of(contexts, [1, 1, 1, 1]) == [([0, 2], 380), ([1, 3], 380)]


def test_the_prefix_stays_within_what_every_new_token_sees() -> None:
    prefix = torch.arange(300)
    whole = prefix[:200]  # a decode row whose context is the shared prefix itself
    extend = torch.cat([prefix, torch.arange(400, 408)])  # 8 new tokens: only its first 301 slots are seen by all
    contexts = [whole, extend, torch.cat([prefix, torch.tensor([999])])]
    assert groups_of(contexts, [1, 8, 1]) == [([0, 1, 2], 200)]
    assert groups_of([extend, prefix[:250].clone()], [8, 1]) == [([0, 1], 250)]
    assert PagedIndex.build(contexts, [1, 8, 1], cascade=False).shared.lens.size == 0


def cascade_layout(page_size: int, seed: int) -> tuple[list[torch.Tensor], list[int], int]:
    """Three prefixes (~1,000, ~300 and 40 slots: below the threshold), members decoding or extending on
    them, a member that is its prefix alone, and requests of their own; shuffled."""
    rng = np.random.default_rng(seed)
    take = slot_taker(8192, page_size, rng)

    prefixes = [take(int(rng.integers(900, 1100))), take(int(rng.integers(200, 400))), take(40)]
    items = [(prefixes[1], 1)]  # its whole context is the prefix its group shares
    for prefix, count in zip(prefixes, (9, 4, 3)):
        for _ in range(count):
            extend_len = int(rng.choice([1, 1, 1, 3, 8]))
            items.append((torch.cat([prefix, take(int(rng.integers(0, 40)) + extend_len)]), extend_len))
    items += [(take(int(rng.integers(1, 600))), 1) for _ in range(3)]
    order = rng.permutation(len(items))
    return [items[i][0] for i in order], [items[i][1] for i in order], 8192 + page_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(2))
def test_cascade_kernel_equals_gather_and_sdpa(dtype: torch.dtype, page_size: int, seed: int) -> None:
    contexts, lens, num_slots = cascade_layout(page_size, seed)
    generator = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, KV_HEADS, num_slots, HEAD_DIM, generator=generator).to(dtype)
    q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=generator).to(dtype)
    expected = reference(q, k, v, contexts, lens)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            index = PagedIndex.build(contexts, lens)
            got = paged_attention(q, k, v, index)
        finally:
            torch.set_num_threads(1)
        assert sorted(np.diff(index.shared.starts).tolist()) == [
            5,
            9,
        ]  # 4 + the whole-context row; 9; not the 40-slot one
        assert got.dtype == dtype and (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    "members,starts,lens,message",
    [([0, 5], [0, 2], [10], "not a request"), ([0, 0], [0, 2], [10], "twice"), ([0, 1], [0, 2], [30], "cached part")],
)
def test_kernel_rejects_groups_that_do_not_fit_the_batch(
    members: list[int], starts: list[int], lens: list[int], message: str
) -> None:
    k = v = torch.zeros(KV_HEADS, 64, HEAD_DIM)
    q = torch.zeros(2, HEADS, HEAD_DIM)
    slots = torch.arange(40)
    groups = [torch.tensor(x, dtype=torch.int64) for x in (members, starts, lens)]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.radixserve.paged_attention(
            q, k, v, slots, torch.tensor([0, 1, 2]), torch.tensor([0, 20, 40]), *groups, 1, 0.125
        )


def test_sixty_four_members_on_one_prefix_form_one_group() -> None:
    prefix = np.arange(2048)
    slots = np.concatenate([np.concatenate([prefix, [5000 + i]]) for i in range(64)])
    ctx_starts = np.arange(65) * 2049
    found = find_shared_prefixes(slots, ctx_starts, np.ones(64, np.int64))
    assert found.lens.tolist() == [2048] and found.members.tolist() == list(range(64))
