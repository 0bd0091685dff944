"""KVPool's CPU allocation: one zeroed buffer, its whole 2 MiB pages advised onto transparent huge pages."""

from __future__ import annotations

import pytest
import torch

from radixserve.memory.kv_pool import HUGE_PAGE, KVPool, huge_page_interior, hugepages_on_advice


def test_huge_page_interior_is_the_whole_pages_inside() -> None:
    assert huge_page_interior(HUGE_PAGE, 3 * HUGE_PAGE) == (HUGE_PAGE, 3 * HUGE_PAGE)
    assert huge_page_interior(HUGE_PAGE + 64, 3 * HUGE_PAGE) == (2 * HUGE_PAGE, 2 * HUGE_PAGE)
    assert huge_page_interior(HUGE_PAGE - 64, 2 * HUGE_PAGE) == (HUGE_PAGE, HUGE_PAGE)
    assert huge_page_interior(HUGE_PAGE + 64, HUGE_PAGE) == (2 * HUGE_PAGE, 0)
    assert huge_page_interior(64, 100) == (HUGE_PAGE, 0)


def test_layers_are_separate_zeroed_tensors_of_one_buffer() -> None:
    pool = KVPool(3, 50, 2, 8, torch.bfloat16)
    tensors = pool.k + pool.v
    assert all(t.shape == (2, 50, 8) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert all(not t.any() for t in tensors)
    pool.write(1, torch.tensor([3, 7]), torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    assert [int(t.count_nonzero()) for t in tensors] == [0, 32, 0, 0, 32, 0]
    assert pool.k[1][:, [3, 7]].eq(1).all() and pool.v[1][:, [3, 7]].eq(2).all()


def anon_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (kB) of this process's mappings that overlap [lo, hi), from /proc/self/smaps."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                overlaps = start < hi and end > lo
            elif head[0] == "AnonHugePages:" and overlaps:
                total += int(head[1])
    return total


@pytest.mark.skipif(not hugepages_on_advice(), reason="the kernel's THP mode is never (or not Linux)")
def test_the_pool_lies_on_huge_pages() -> None:
    pool = KVPool(2, 16384, 2, 64, torch.bfloat16)  # 16 MiB, in a mapping of its own from a 2 MiB boundary
    lo = pool.k[0].data_ptr()
    hi = pool.v[1].data_ptr() + pool.v[1].numel() * pool.v[1].element_size()
    assert lo % HUGE_PAGE == 0 and anon_huge_kib(lo, hi) * 1024 >= (hi - lo) // 2
    assert all(not t.any() for t in pool.k + pool.v)
    pool.write(1, torch.tensor([5, 16383]), torch.ones(2, 2, 64), torch.full((2, 2, 64), 3.0))
    assert pool.k[1][:, [5, 16383]].eq(1).all() and int(pool.v[1].count_nonzero()) == 256
