"""Copies into a lower cache tier and its drops go on the wire with vLLM's ``medium``; the pool mirror ignores them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from radixserve.cache import RadixCache, RadixKey
from radixserve.cache.tiers import TierIndex
from radixserve.kv_events.wire import (
    AllBlocksCleared,
    BlockMirror,
    BlockRemoved,
    BlockStored,
    block_hashes,
    decode_batch,
    encode_batch,
    event_record,
)
from radixserve.memory import TokenAllocator
from radixserve.memory.disk_format import HEADER
from radixserve.memory.disk_store import DiskPageStore
from radixserve.memory.host_arena import HostArena
from radixserve.memory.kv_pages import PoolPageMover
from radixserve.memory.kv_pool import KVPool


def test_demoted_blocks_carry_their_medium_and_leave_the_pool_mirror_exact() -> None:
    cache = RadixCache(TokenAllocator(32), 1, enable_kv_events=True)
    mover = PoolPageMover(KVPool(1, 33, 1, 2), 16)
    cache.tiers = TierIndex(mover, 16, HostArena(1 << 20), None)
    cache.tiers.events = cache.events
    assert cache.events is not None
    tokens = np.arange(3, 35, dtype=np.int64)  # two 16-token blocks
    req = cache.open_request(RadixKey(tokens))
    assert cache.extend_request(req, tokens)
    cache.cache_finished_req(req)
    cache.evict(32)
    records = [event_record(e, 16) for e in cache.events.drain()]
    wire = decode_batch(encode_batch([r for r in records if r is not None])).events
    stored = [e for e in wire if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == [None, "cpu", "cpu"]
    assert stored[1].block_hashes + stored[2].block_hashes == stored[0].block_hashes
    assert [e.medium for e in wire if isinstance(e, BlockRemoved)] == [None]
    mirror = BlockMirror()
    mirror.apply(0, decode_batch(encode_batch(wire)))
    assert mirror.blocks == set()  # the pool holds nothing now; the host tier's copies are not the pool's


PAGE_BYTES = 2 * 16 * 2 * 4  # one 16-token tier page of KVPool(1 layer, 1 head, head_dim 2), K and V, fp32


def _cached_and_evicted(cache: RadixCache, tokens: np.ndarray) -> None:
    req = cache.open_request(RadixKey(tokens))  # loads back what L2 holds of it
    assert cache.extend_request(req, tokens[len(req.key) :])
    cache.cache_finished_req(req)
    cache.evict(len(tokens))


def _wire(cache: RadixCache, block_size: int = 16) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    assert cache.events is not None
    records = [event_record(e, block_size) for e in cache.events.drain()]
    return decode_batch(encode_batch([r for r in records if r is not None])).events


def _tier_removals(wire: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> list[tuple[str | None, list[int]]]:
    return [(e.medium, e.block_hashes) for e in wire if isinstance(e, BlockRemoved) and e.medium is not None]


def test_a_page_the_host_tier_drops_is_announced_once_with_medium_cpu() -> None:
    cache = RadixCache(TokenAllocator(32), 1, enable_kv_events=True)
    cache.tiers = TierIndex(PoolPageMover(KVPool(1, 33, 1, 2), 16), 16, HostArena(PAGE_BYTES), None)
    cache.tiers.events = cache.events
    tokens = np.arange(3, 35, dtype=np.int64)
    _cached_and_evicted(cache, tokens)  # both pages go to L2, which holds one: the first is dropped
    wire = _wire(cache)
    first, second = [e.block_hashes for e in wire if isinstance(e, BlockStored) and e.medium == "cpu"]
    assert _tier_removals(wire) == [("cpu", first)]
    assert cache.tiers.page_states(cache.tiers.hashes(RadixKey(tokens), 32)[0]) == (False, "absent")
    # Twice more before a drain: each page is dropped and stored again in turn, and L2 ends with the first.
    _cached_and_evicted(cache, tokens)
    _cached_and_evicted(cache, tokens)
    assert cache.events is not None
    drops = [e for e in cache.events.drain() if e.page_hash is not None]
    assert [event_record(e, 32) for e in drops] == [None]  # a 16-token page has no hash at another block size
    removals = decode_batch(encode_batch([event_record(e, 16) for e in drops])).events
    assert _tier_removals(removals) == [("cpu", second)]  # the first was dropped too, but is back: not gone
    assert [cache.tiers.page_states(h)[0] for h in cache.tiers.hashes(RadixKey(tokens), 32)] == [True, False]


def test_a_page_the_disk_writer_evicts_is_announced_at_the_next_drain_with_medium_disk(tmp_path: Path) -> None:
    cache = RadixCache(TokenAllocator(32), 1, enable_kv_events=True)
    disk = DiskPageStore(tmp_path, HEADER.size + PAGE_BYTES, {"model": "test"})  # room for one page file
    cache.tiers = TierIndex(PoolPageMover(KVPool(1, 33, 1, 2), 16), 16, None, disk)
    cache.tiers.events = cache.events
    try:
        _cached_and_evicted(cache, np.arange(3, 35, dtype=np.int64))
        assert disk.flush(60)  # the writer thread wrote the first page, then evicted it for the second
        assert disk.stats.evicted == 1 and len(disk) == 1
        wire = _wire(cache)
    finally:
        cache.tiers.close(5)
    first, _ = [e.block_hashes for e in wire if isinstance(e, BlockStored) and e.medium == "disk"]
    assert _tier_removals(wire) == [("disk", first)]
    assert _wire(cache) == []  # announced once


def test_the_pool_mirror_keeps_a_block_the_pool_holds_when_a_tier_drops_its_copy() -> None:
    cache = RadixCache(TokenAllocator(32), 1, enable_kv_events=True)
    mover = PoolPageMover(KVPool(1, 33, 1, 2), 16)
    cache.tiers = TierIndex(mover, 16, HostArena(1 << 20), None, write_policy="write_through")
    cache.tiers.events = cache.events
    tokens = np.arange(3, 35, dtype=np.int64)
    req = cache.open_request(RadixKey(tokens))
    assert cache.extend_request(req, tokens)
    cache.cache_finished_req(req)  # in the pool and, written through, in L2
    cache.tiers.clear_host()
    wire = _wire(cache)
    pool = block_hashes(RadixKey(tokens), 16)
    assert sorted(h for _, hashes in _tier_removals(wire) for h in hashes) == sorted(pool)
    mirror = BlockMirror()
    mirror.apply(0, decode_batch(encode_batch(wire)))
    assert mirror.blocks == set(pool)  # the removals name the host tier's copies, not the pool's blocks


def test_a_read_only_disk_tier_announces_no_copies_it_did_not_take(tmp_path: Path) -> None:
    owner = DiskPageStore(tmp_path, 1 << 20, {"model": "test"})  # holds the directory's lock
    reader = DiskPageStore(tmp_path, 1 << 20, {"model": "test"})
    assert reader.enabled and not reader.writable
    cache = RadixCache(TokenAllocator(32), 1, enable_kv_events=True)
    cache.tiers = TierIndex(PoolPageMover(KVPool(1, 33, 1, 2), 16), 16, None, reader)
    cache.tiers.events = cache.events
    try:
        _cached_and_evicted(cache, np.arange(3, 35, dtype=np.int64))
        assert [e.medium for e in _wire(cache)] == [None, None]  # the pool's store and removal only
    finally:
        cache.tiers.close(5)
        owner.close(0)
