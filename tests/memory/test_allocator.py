import numpy as np
import pytest

from radixserve.memory import AllocatorError, TokenAllocator


def test_alloc_hands_out_distinct_slots_and_never_slot_zero() -> None:
    allocator = TokenAllocator(8)
    a = allocator.alloc(5)
    b = allocator.alloc(3)
    assert a is not None and b is not None
    assert a.dtype == np.int64 and a.ndim == 1
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(1, 9))
    assert allocator.free_size() == 0


def test_alloc_is_never_partial() -> None:
    allocator = TokenAllocator(8)
    assert allocator.alloc(9) is None
    assert allocator.free_size() == 8
    assert allocator.alloc(8) is not None
    assert allocator.alloc(1) is None


def test_free_returns_slots_for_reuse() -> None:
    allocator = TokenAllocator(4)
    slots = allocator.alloc(4)
    assert slots is not None
    allocator.free(slots[:2])
    assert allocator.free_size() == 2
    again = allocator.alloc(2)
    assert again is not None and sorted(again.tolist()) == sorted(slots[:2].tolist())


def test_double_free_raises_and_changes_nothing() -> None:
    allocator = TokenAllocator(4)
    slots = allocator.alloc(2)
    assert slots is not None
    allocator.free(slots)
    with pytest.raises(AllocatorError):
        allocator.free(slots)
    assert allocator.free_size() == 4


def test_duplicate_slot_in_one_free_raises() -> None:
    allocator = TokenAllocator(4)
    slots = allocator.alloc(2)
    assert slots is not None
    with pytest.raises(AllocatorError):
        allocator.free(np.array([slots[0], slots[0]]))
    assert allocator.free_size() == 2


@pytest.mark.parametrize("stray", [0, 3, 99, -1])
def test_free_of_slot_never_handed_out_raises(stray: int) -> None:
    allocator = TokenAllocator(4)
    assert allocator.alloc(2) is not None  # slots 1, 2
    with pytest.raises(AllocatorError):
        allocator.free(np.array([stray]))
    assert allocator.free_size() == 2


def test_paged_alloc_hands_out_whole_pages() -> None:
    allocator = TokenAllocator(16, page_size=4)
    slots = allocator.alloc(6)
    assert slots is not None and len(slots) == 6
    assert slots[0] % 4 == 0 and slots.tolist() == list(range(slots[0], slots[0] + 6))
    assert allocator.free_size() == 8  # two pages taken
    assert 0 not in slots.tolist() and slots.min() >= 4  # page 0 is padding


def test_paged_free_of_partial_page_frees_that_page() -> None:
    allocator = TokenAllocator(16, page_size=4)
    slots = allocator.alloc(6)
    assert slots is not None
    allocator.free(slots[4:])  # the partial last page
    assert allocator.free_size() == 12
    with pytest.raises(AllocatorError):
        allocator.free(slots[5:6])
    allocator.free(slots[:4])
    assert allocator.free_size() == 16


def test_size_must_be_whole_pages() -> None:
    with pytest.raises(ValueError):
        TokenAllocator(10, page_size=4)


def test_free_slots_and_is_free_agree() -> None:
    allocator = TokenAllocator(12, page_size=2)
    taken = allocator.alloc(5)
    assert taken is not None
    free = allocator.free_slots()
    assert len(free) == allocator.free_size() == 6
    assert allocator.is_free(free).all() and not allocator.is_free(taken).any()
    assert set(free.tolist()).isdisjoint(taken.tolist())


def test_large_pool_reuses_freed_slots_lifo() -> None:
    """Freed slots are handed out again first (hot in cache), whatever the pool size."""
    allocator = TokenAllocator(1 << 22)
    for _ in range(1000):
        slots = allocator.alloc(3)
        assert slots is not None and slots.tolist() == [1, 2, 3]
        allocator.free(slots)
    assert allocator.free_size() == 1 << 22
