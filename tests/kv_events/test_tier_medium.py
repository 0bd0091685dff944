"""Copies into a lower cache tier and its drops go on the wire with their ``medium``; the pool's set ignores them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from radixserve.cache import KVEvent, KVEventLog, RadixCache, RadixKey
from radixserve.cache.tiers.disk_format import HEADER
from radixserve.cache.tiers.disk_store import DiskPageStore
from radixserve.cache.tiers.host_arena import HostArena
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import PoolPageMover
from radixserve.kv_events.mirror import BlockMirror
from radixserve.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    decode_batch,
    encode_batch,
    event_record,
    tier_of,
    wire_hash,
)
from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool


def test_demoted_blocks_carry_their_medium_and_leave_the_pool_mirror_exact() -> None:
    events = KVEventLog(1)
    mover = PoolPageMover(KVPool(1, 33, 1, 2), 16)
    tiers = TierIndex(mover, 16, HostArena(1 << 20), None, events=events)
    cache = RadixCache(TokenAllocator(32), 1, listeners=[events], tiers=tiers)
    assert cache.events is not None
    tokens = np.arange(3, 35, dtype=np.int64)  # two 16-token blocks
    req = cache.open_request(RadixKey(tokens))
    assert cache.extend_request(req, tokens)
    cache.cache_finished_req(req)
    cache.evict(32)
    records = [event_record(e, 16) for e in cache.events.drain()]
    wire = decode_batch(encode_batch([r for r in records if r is not None])).events
    stored = [e for e in wire if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == [None, "CPU_PINNED", "CPU_PINNED"]
    assert stored[1].block_hashes + stored[2].block_hashes == stored[0].block_hashes
    assert [e.medium for e in wire if isinstance(e, BlockRemoved)] == [None]
    mirror = BlockMirror()
    mirror.apply(0, decode_batch(encode_batch(wire)))
    assert mirror.blocks == set()  # the pool holds nothing now; the host tier's copies are not the pool's
    assert mirror.media == {"cpu": set(stored[0].block_hashes), "disk": set()}


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
    return [(tier_of(e.medium), e.block_hashes) for e in wire if isinstance(e, BlockRemoved) and e.medium is not None]


class MediumMirror:
    """A subscriber's view of every medium (by tier name), from wire events: exact, or it raises (a page stored
    twice, a removal of a page it never saw; a page announced by hash alone may be stored once more, in full).
    ``AllBlocksCleared`` clears the pool only: the tiers announce their own removals."""

    def __init__(self) -> None:
        self.blocks: dict[str | None, set[int]] = {None: set(), "cpu": set(), "disk": set()}
        self.stored: dict[int, BlockStored] = {}  # a tier page's last BlockStored (in any tier)

    def apply(self, wire: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        for event in wire:
            if isinstance(event, AllBlocksCleared):
                self.blocks[None].clear()
                continue
            blocks = self.blocks[tier_of(event.medium)]
            for block in event.block_hashes:
                bare = block in self.stored and not self.stored[block].token_ids and isinstance(event, BlockStored)
                if event.medium is not None and not (bare and event.token_ids):  # the pool: a block once per path
                    assert (block in blocks) == isinstance(event, BlockRemoved), (event, blocks)
                if isinstance(event, BlockStored):
                    blocks.add(block)
                    if event.medium is not None:
                        self.stored[block] = event
                else:
                    blocks.discard(block)


def _tier_blocks(tiers: TierIndex) -> dict[str, set[int]]:
    """What the tiers hold now, as wire hashes per medium."""
    host = {wire_hash(h) for h in tiers.host.hashes()} if tiers.host is not None else set()
    disk = {wire_hash(h) for h in tiers.disk._index} if tiers.disk is not None else set()
    return {"cpu": host, "disk": disk}


def _page_record(tokens: np.ndarray, index: int, medium: str) -> BlockStored:  # medium: the tier's name
    """The BlockStored of page ``index`` as the tier would announce it straight from the pool (the key's own event)."""
    event = KVEvent(0, "store", index * 16, RadixKey(tokens[: (index + 1) * 16]), 16, medium)
    record = event_record(event, 16)
    assert isinstance(record, BlockStored)
    return record


def test_a_page_the_host_tier_drops_is_announced_once_with_medium_cpu() -> None:
    events = KVEventLog(1)
    tiers = TierIndex(PoolPageMover(KVPool(1, 33, 1, 2), 16), 16, HostArena(PAGE_BYTES), None, events=events)
    cache = RadixCache(TokenAllocator(32), 1, listeners=[events], tiers=tiers)
    a, b = np.arange(3, 19, dtype=np.int64), np.arange(50, 66, dtype=np.int64)  # one page each
    (first,), (second,) = block_hashes(RadixKey(a), 16), block_hashes(RadixKey(b), 16)
    mirror = MediumMirror()
    _cached_and_evicted(cache, a)  # L2 holds one page: a's
    mirror.apply(_wire(cache))
    assert mirror.blocks["cpu"] == {first} == _tier_blocks(cache.tiers)["cpu"]
    _cached_and_evicted(cache, b)  # b's page pushes a's out of L2
    wire = _wire(cache)
    assert _tier_removals(wire) == [("cpu", [first])]
    mirror.apply(wire)
    assert mirror.blocks["cpu"] == {second} == _tier_blocks(cache.tiers)["cpu"]
    # Three more before a drain: each page is dropped and stored again in turn; L2 ends with a's, and the
    # drain announces only that difference (no churn, nothing stored twice).
    for tokens in (a, b, a):
        _cached_and_evicted(cache, tokens)
    assert cache.events is not None
    tier_events = [e for e in cache.events.drain() if e.page_hash is not None]
    assert [event_record(e, 32) for e in tier_events] == [None, None]  # a 16-token page has no hash at 32
    wire = decode_batch(encode_batch([event_record(e, 16) for e in tier_events])).events
    assert [(type(e).__name__, e.block_hashes) for e in wire] == [("BlockRemoved", [second]), ("BlockStored", [first])]
    mirror.apply(wire)
    assert mirror.blocks["cpu"] == {first} == _tier_blocks(cache.tiers)["cpu"]


def test_a_page_the_disk_writer_evicts_is_announced_at_the_next_drain_with_medium_disk(tmp_path: Path) -> None:
    events = KVEventLog(1)
    disk = DiskPageStore(tmp_path, HEADER.size + PAGE_BYTES, {"model": "test"})  # room for one page file
    tiers = TierIndex(PoolPageMover(KVPool(1, 33, 1, 2), 16), 16, None, disk, events=events)
    cache = RadixCache(TokenAllocator(32), 1, listeners=[events], tiers=tiers)
    a, b = np.arange(3, 19, dtype=np.int64), np.arange(50, 66, dtype=np.int64)  # one page each
    (first,), (second,) = block_hashes(RadixKey(a), 16), block_hashes(RadixKey(b), 16)
    mirror = MediumMirror()
    try:
        _cached_and_evicted(cache, a)
        mirror.apply(_wire(cache))  # queued for the writer counts as held
        assert mirror.blocks["disk"] == {first}
        assert disk.flush(60)
        _cached_and_evicted(cache, b)
        assert disk.flush(60)  # the writer thread wrote b's page and evicted a's for it
        assert disk.stats.evicted == 1 and len(disk) == 1
        wire = _wire(cache)
        assert _tier_removals(wire) == [("disk", [first])]
        mirror.apply(wire)
        assert mirror.blocks["disk"] == {second} == _tier_blocks(cache.tiers)["disk"]
    finally:
        cache.tiers.close(5)
    assert _wire(cache) == []  # announced once


def test_a_page_the_host_tier_spills_to_disk_is_announced_as_stored_on_disk(tmp_path: Path) -> None:
    events = KVEventLog(1)
    disk = DiskPageStore(tmp_path, 1 << 20, {"model": "test"})
    tiers = TierIndex(PoolPageMover(KVPool(1, 49, 1, 2), 16), 16, HostArena(2 * PAGE_BYTES), disk, events=events)
    cache = RadixCache(TokenAllocator(48), 1, listeners=[events], tiers=tiers)
    tokens = np.arange(3, 51, dtype=np.int64)  # three pages
    hashes = block_hashes(RadixKey(tokens), 16)
    mirror = MediumMirror()
    try:
        _cached_and_evicted(cache, tokens)  # all three into L2, in order: the third spills the first to disk
        assert disk.flush(60)
        mirror.apply(_wire(cache))
        assert {m: b for m, b in mirror.blocks.items() if m} == _tier_blocks(cache.tiers)
        assert mirror.blocks["disk"] == {hashes[0]} and mirror.blocks["cpu"] == set(hashes[1:])
        # The spilled page is announced exactly as a copy straight from the pool would be: parent, tokens, size.
        assert mirror.stored[hashes[0]] == _page_record(tokens, 0, "disk")
        assert mirror.stored[hashes[2]] == _page_record(tokens, 2, "cpu")
        assert mirror.stored[hashes[2]].parent_block_hash == hashes[1]
        # A queued request prefetches the first page back into L2, which spills the second to disk.
        assert cache.tiers.prefetch(RadixKey(tokens), 0) == 1
        assert disk.flush(60)
        mirror.apply(_wire(cache))
        assert mirror.blocks["cpu"] == {hashes[0], hashes[2]} and mirror.blocks["disk"] == set(hashes[:2])
        assert {m: b for m, b in mirror.blocks.items() if m} == _tier_blocks(cache.tiers)
        assert mirror.stored[hashes[0]] == _page_record(tokens, 0, "cpu")
        assert mirror.stored[hashes[1]] == _page_record(tokens, 1, "disk")
    finally:
        cache.tiers.close(5)


def test_the_pool_mirror_keeps_a_block_the_pool_holds_when_a_tier_drops_its_copy() -> None:
    events = KVEventLog(1)
    mover = PoolPageMover(KVPool(1, 33, 1, 2), 16)
    tiers = TierIndex(mover, 16, HostArena(1 << 20), None, write_policy="write_through", events=events)
    cache = RadixCache(TokenAllocator(32), 1, listeners=[events], tiers=tiers)
    tokens = np.arange(3, 35, dtype=np.int64)
    req = cache.open_request(RadixKey(tokens))
    assert cache.extend_request(req, tokens)
    cache.cache_finished_req(req)  # in the pool and, written through, in L2
    wire = _wire(cache)
    cache.tiers.clear_host()
    wire += _wire(cache)
    pool = block_hashes(RadixKey(tokens), 16)
    assert sorted(h for _, hashes in _tier_removals(wire) for h in hashes) == sorted(pool)
    mirror = BlockMirror()
    mirror.apply(0, decode_batch(encode_batch(wire)))
    assert mirror.blocks == set(pool)  # the removals name the host tier's copies, not the pool's blocks


def test_a_read_only_disk_tier_announces_no_copies_it_did_not_take(tmp_path: Path) -> None:
    owner = DiskPageStore(tmp_path, 1 << 20, {"model": "test"})  # holds the directory's lock
    reader = DiskPageStore(tmp_path, 1 << 20, {"model": "test"})
    assert reader.enabled and not reader.writable
    events = KVEventLog(1)
    tiers = TierIndex(PoolPageMover(KVPool(1, 33, 1, 2), 16), 16, None, reader, events=events)
    cache = RadixCache(TokenAllocator(32), 1, listeners=[events], tiers=tiers)
    try:
        _cached_and_evicted(cache, np.arange(3, 35, dtype=np.int64))
        assert [e.medium for e in _wire(cache)] == [None, None]  # the pool's store and removal only
    finally:
        cache.tiers.close(5)
        owner.close(0)


def test_a_subscriber_sees_each_tier_exactly_after_a_run_that_spills_and_drops(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from radixserve import Engine
    from radixserve.kv_events.publisher import KVEventPublisher
    from radixserve.kv_events.subscriber import KVEventSubscriber
    from tests.server.test_kv_events import drain, expected_blocks, workload

    probe = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=128, hicache_size=0.001)
    assert probe.cache.tiers is not None
    page_bytes = probe.cache.tiers.mover.layout.page_bytes  # type: ignore[attr-defined]
    gib = float(1 << 30)
    engine = Engine.create(  # L2 of 4 pages, L3 of 8: both spill and drop all the time
        model_path=str(tiny_model_dir),
        max_total_tokens=128,
        enable_kv_events=True,
        hicache_size=4 * page_bytes / gib,
        cache_dir=str(tmp_path / "kv"),
        cache_dir_size=8 * (page_bytes + HEADER.size) / gib,
    )
    tiers, events = engine.cache.tiers, engine.cache.events
    assert tiers is not None and tiers.disk is not None and events is not None
    publisher = KVEventPublisher(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/events.replay", block_size=16)
    subscriber = KVEventSubscriber(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/events.replay")
    mirror = MediumMirror()
    try:
        for prompt, ns in workload(3, 60):
            engine.scheduler.add(engine.make_request(prompt, {"max_new_tokens": 4, "ignore_eos": True}, ns))
            while engine.scheduler.has_work():
                engine.step()
                tiers.disk.flush(60)  # the writer's drops land before this drain, not in the next one
                batch = events.drain()
                publisher.publish(batch)
                mirror.apply([r for r in (event_record(e, 16) for e in batch) if r is not None])
        assert tiers.prefetcher is None or tiers.prefetcher.wait_idle(60)  # a prefetch may still be filling L2
        assert tiers.disk.flush(60)
        batch = events.drain()
        publisher.publish(batch)
        mirror.apply([r for r in (event_record(e, 16) for e in batch) if r is not None])
        assert tiers.disk.stats.evicted > 0 and tiers.stats.bytes_stored["disk"] > 0  # L2 spilled, L3 dropped
        assert {m: b for m, b in mirror.blocks.items() if m} == _tier_blocks(tiers)
        drain(subscriber, publisher)
        assert subscriber.blocks == expected_blocks(engine.cache)  # type: ignore[arg-type]  # the pool, as before
        assert mirror.blocks[None] == subscriber.blocks
    finally:
        subscriber.close()
        publisher.close()
        engine.close(30)
