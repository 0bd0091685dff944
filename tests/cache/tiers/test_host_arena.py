"""The host tier: byte-bounded LRU, lossless by default, int8 compression on request."""

from __future__ import annotations

import torch

from radixserve.cache.tiers.host_arena import HostArena


def page(seed: int) -> torch.Tensor:
    return torch.randn((2, 2, 3, 16, 8), generator=torch.Generator().manual_seed(seed))


def test_lossless_round_trip_and_lru_spill() -> None:
    size = page(0).numel() * 4
    arena = HostArena(2 * size)
    assert arena.put(b"a", page(0)) == [] and arena.put(b"b", page(1)) == []
    assert torch.equal(arena.get(b"a"), page(0))  # type: ignore[arg-type]  # a is now most recent
    spilled = arena.put(b"c", page(2))
    assert [h for h, _ in spilled] == [b"b"] and torch.equal(spilled[0][1], page(1))
    assert b"b" not in arena and len(arena) == 2
    arena.check()


def test_a_page_larger_than_the_arena_is_handed_back() -> None:
    arena = HostArena(10)
    assert [h for h, _ in arena.put(b"a", page(0))] == [b"a"] and len(arena) == 0
    arena.check()


def test_int8_holds_about_four_times_more_and_stays_close() -> None:
    size = page(0).numel() * 4
    arena = HostArena(size, compress=True)
    for i in range(3):
        assert arena.put(bytes([i]), page(i)) == []
    back = arena.get(b"\x01")
    assert back is not None and back.dtype == torch.float32
    error = (back - page(1)).abs().max().item()
    assert 0 < error <= page(1).abs().max().item() / 127
    arena.check()


def test_8bit_pool_pages_are_stored_as_they_are_even_when_compressing() -> None:
    """An int8 pool's page (codes and their scale bytes) is 8 bits already: never quantized a second time."""
    page = torch.randint(-127, 128, (2, 2, 3, 16, 66), dtype=torch.int8)
    arena = HostArena(1 << 20, compress=True)
    arena.put(b"p" * 16, page)
    got = arena.get(b"p" * 16)
    assert got is not None and torch.equal(got, page) and arena.used_bytes == page.numel()
