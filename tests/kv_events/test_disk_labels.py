"""A restarted engine announces its disk pages in full, from the labels their files keep: parent, tokens, namespace.

Before any request, the first drain announces every page on disk as a complete
``BlockStored`` (medium ``DISK``), parents before children whatever order the
files were written in; a request that then reads them announces nothing more.
A version 1 file (no label) is still read and goes out by hash alone until a
request reads it; a label damaged, cut short or not its page's fails the page's
check like corrupt K/V: dropped, counted, never announced.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from radixserve.cache import KVEvent, KVEventLog, RadixCache, RadixKey
from radixserve.cache.tiers.disk_format import HEADER, HEADER_V1, MAGIC_V1, decode_page, encode_page
from radixserve.cache.tiers.disk_store import DiskPageStore
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import PoolPageMover
from radixserve.kv_events.wire import BlockStored, block_hashes, encode_batch, event_record, wire_hash
from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool
from tests.kv_events.peers import sglang_kv_events
from tests.kv_events.test_tier_medium import MediumMirror, _tier_blocks, _wire

TOKENS = np.arange(3, 51, dtype=np.int64)  # three 16-token tier pages
NS = "tenant-a"


def tiered_cache(directory: Path, events: bool) -> RadixCache:
    log = KVEventLog(1) if events else None
    disk = DiskPageStore(directory, 1 << 20, {"model": "test"})
    tiers = TierIndex(PoolPageMover(KVPool(1, 49, 1, 2), 16), 16, None, disk, events=log)
    return RadixCache(TokenAllocator(48), 1, listeners=[log] if log is not None else [], tiers=tiers)


def written(directory: Path) -> tuple[list[bytes], list[Path]]:
    """A first process (events off) caches TOKENS in namespace NS and stops: its three pages are on disk, and their
    files are made oldest last, so the scan finds children before parents. Returns the page hashes and files."""
    cache = tiered_cache(directory, events=False)
    req = cache.open_request(RadixKey(TOKENS, NS))
    assert cache.extend_request(req, TOKENS)
    cache.cache_finished_req(req)
    cache.evict(len(TOKENS))  # to the disk, with their labels
    assert cache.tiers is not None and cache.tiers.disk is not None
    hashes = cache.tiers.hashes(RadixKey(TOKENS, NS), len(TOKENS))
    paths = [cache.tiers.disk._path(h) for h in hashes]
    cache.tiers.close(30)
    for age, path in enumerate(paths):  # page 0 newest, page 2 oldest
        os.utime(path, (1e9 - age, 1e9 - age))
    return hashes, paths


def full_record(index: int, medium: str = "disk") -> BlockStored:
    """Page ``index`` of TOKENS in NS, as a copy straight from the pool announces it."""
    event = KVEvent(0, "store", index * 16, RadixKey(TOKENS[: (index + 1) * 16], NS), 16, medium)
    record = event_record(event, 16)
    assert isinstance(record, BlockStored)
    return record


def test_a_restart_announces_every_disk_page_in_full_parents_first_and_a_read_adds_nothing(tmp_path: Path) -> None:
    hashes, _ = written(tmp_path)
    cache = tiered_cache(tmp_path, events=True)
    assert cache.tiers is not None and cache.tiers.disk is not None
    assert cache.tiers.disk.hashes() == hashes[::-1]  # the scan's order: oldest file first, children first
    mirror = MediumMirror()
    try:
        wire = _wire(cache)  # before any request
        assert wire == [full_record(0), full_record(1), full_record(2)]
        mirror.apply(wire)
        assert mirror.blocks["disk"] == set(block_hashes(RadixKey(TOKENS, NS), 16)) == _tier_blocks(cache.tiers)["disk"]
        req = cache.open_request(RadixKey(TOKENS, NS))  # loads the three pages back from disk
        assert len(req.key) == 48 and cache.tiers.stats.hit_tokens["disk"] == 48
        cache.cache_finished_req(req)
        assert [e for e in _wire(cache) if e.medium is not None] == []  # announced once, in full: not again
        assert cache.tiers.disk.stats.corrupt == 0
    finally:
        cache.tiers.close(5)


def to_version_1(path: Path, page_hash: bytes, digest: bytes) -> None:
    """Rewrite a page file as the previous format wrote it: a 64-byte header, no label."""
    payload = decode_page(page_hash, digest, path.read_bytes())
    assert payload is not None
    checksum = hashlib.blake2b(payload, digest_size=16).digest()
    path.write_bytes(HEADER_V1.pack(MAGIC_V1, page_hash, digest, checksum, len(payload)) + payload)


def test_version_1_files_load_and_are_announced_by_hash_until_read(tmp_path: Path) -> None:
    hashes, paths = written(tmp_path)
    digest = DiskPageStore(tmp_path / "other", 1, {"model": "test"}).digest
    to_version_1(paths[1], hashes[1], digest)
    cache = tiered_cache(tmp_path, events=True)
    assert cache.tiers is not None and cache.tiers.disk is not None
    mirror = MediumMirror()
    try:
        wire = _wire(cache)
        placeholder = BlockStored(full_record(1).block_hashes, None, [], 0, medium="DISK")
        assert wire == [placeholder, full_record(2), full_record(0)]  # page 2 still follows its parent
        mirror.apply(wire)
        req = cache.open_request(RadixKey(TOKENS, NS))  # the old file's K/V loads like any other
        assert len(req.key) == 48
        cache.cache_finished_req(req)
        assert [e for e in _wire(cache) if e.medium is not None] == [full_record(1)]  # now its tokens are known
        assert cache.tiers.disk.stats.corrupt == 0
    finally:
        cache.tiers.close(5)


@pytest.mark.parametrize("fault", ["flip", "truncate", "another_pages"])
def test_a_bad_label_fails_the_page_check_and_is_never_announced(tmp_path: Path, fault: str) -> None:
    hashes, paths = written(tmp_path)
    data = bytearray(paths[1].read_bytes())
    if fault == "flip":
        data[HEADER.size + 20] ^= 0x10  # inside the label: its checksum fails
    elif fault == "truncate":
        data = data[: HEADER.size + 30]  # the file ends inside the label
    else:  # page 2's label, under page 1's name and with a valid checksum: it does not hash to page 1
        digest = DiskPageStore(tmp_path / "other", 1, {"model": "test"}).digest
        label_len = HEADER.unpack_from(data)[6]
        payload = bytes(data[HEADER.size + label_len :])
        theirs = paths[2].read_bytes()
        data = bytearray(encode_page(hashes[1], digest, payload, theirs[HEADER.size : HEADER.size + label_len]))
    paths[1].write_bytes(bytes(data))
    cache = tiered_cache(tmp_path, events=True)
    assert cache.tiers is not None and cache.tiers.disk is not None
    try:
        assert _wire(cache) == [full_record(2), full_record(0)]  # page 2 (oldest) no longer follows its parent
        assert cache.tiers.disk.stats.corrupt == 1 and not paths[1].exists()
        assert cache.tiers.disk.state(hashes[1]) == "absent"
        req = cache.open_request(RadixKey(TOKENS, NS))  # the continuation stops where the dropped page was
        assert len(req.key) == 16
        cache.cache_finished_req(req, is_insert=False)
    finally:
        cache.tiers.close(5)


def test_a_restarted_engine_announces_its_disk_in_full_to_a_peer_decoder(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLang's own decoder reads the first publish after a restart: every page with its parent, tokens and size,
    each after its parent; the prompt's pages chain from its first, and serving it again announces none twice."""
    import msgspec

    from radixserve import Engine

    prompt = [int(t) for t in np.arange(10, 90) % 120 + 3]  # 80 tokens: five whole tier pages
    options = {"model_path": str(tiny_model_dir), "max_total_tokens": 256, "cache_dir": str(tmp_path / "kv")}
    first = Engine.create(**options)
    first.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2})
    assert first.close(30)
    engine = Engine.create(**options, enable_kv_events=True)
    events, tiers = engine.cache.events, engine.cache.tiers
    assert events is not None and tiers is not None and tiers.disk is not None
    peer = sglang_kv_events()
    try:
        records = [r for r in (event_record(e, 16) for e in events.drain()) if r is not None]
        batch = msgspec.msgpack.Decoder(peer.KVEventBatch).decode(encode_batch(records))  # the first publish
        stored = [e for e in batch.events if isinstance(e, peer.BlockStored)]
        assert len(stored) == len(batch.events) and {e.block_hashes[0] for e in stored} == {
            wire_hash(h) for h in tiers.disk.hashes()
        }
        assert all(e.medium == "DISK" and e.block_size == 16 and len(e.token_ids) == 16 for e in stored)
        seen: set[int | None] = {None}
        for event in stored:  # each page's parent is the root or was announced before it
            assert event.parent_block_hash in seen, event
            seen.add(event.block_hashes[0])
        pages = block_hashes(RadixKey(np.asarray(prompt, dtype=np.int64)), 16)
        by_hash = {e.block_hashes[0]: e for e in stored}
        assert [by_hash[h].token_ids for h in pages] == [prompt[i * 16 : (i + 1) * 16] for i in range(5)]
        assert [by_hash[h].parent_block_hash for h in pages] == [None, *pages[:-1]]
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2})
        assert tiers.stats.hit_tokens["disk"] >= 64
        again = [e for e in events.drain() if e.kind == "store" and e.medium == "disk" and e.page_hash is not None]
        assert {wire_hash(e.page_hash) for e in again if e.page_hash}.isdisjoint(by_hash)  # none announced twice
    finally:
        engine.close(30)


def test_flush_cache_clears_the_pool_then_the_host_tier_announces_its_drops_and_the_disk_stays(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``/flush_cache?tiers=device,host`` as SGLang's decoder reads it: ``AllBlocksCleared`` (the pool's, as vLLM's
    block pool sends it), then a ``CPU_PINNED`` removal per host page (SGLang reads the clear as device and host:
    redundant there, needed by a reader of the pool's alone), and nothing about the disk, which that flush keeps
    (a full flush's disk removals: tests/test_flush.py)."""
    import msgspec

    from radixserve import Engine
    from radixserve.kv_events.mirror import BlockMirror
    from radixserve.kv_events.wire import decode_batch

    engine = Engine.create(
        model_path=str(tiny_model_dir),
        max_total_tokens=256,
        enable_kv_events=True,
        hicache_size=0.01,
        hicache_write_policy="write_through",
        cache_dir=str(tmp_path / "kv"),
    )
    events, tiers = engine.cache.events, engine.cache.tiers
    assert events is not None and tiers is not None and tiers.disk is not None and tiers.host is not None
    peer = sglang_kv_events()
    mirror = BlockMirror()
    try:
        engine.generate(input_ids=[int(t) for t in np.arange(10, 60)], sampling_params={"max_new_tokens": 2})
        assert tiers.disk.flush(30)
        records = [r for r in (event_record(e, 16) for e in events.drain()) if r is not None]
        mirror.apply(0, decode_batch(encode_batch(records)))
        host, disk = _tier_blocks(tiers)["cpu"], _tier_blocks(tiers)["disk"]
        assert host and disk and mirror.blocks and mirror.media == {"cpu": host, "disk": disk}
        engine.flush_cache(tiers=("device", "host"))
        records = [r for r in (event_record(e, 16) for e in events.drain()) if r is not None]
        batch = msgspec.msgpack.Decoder(peer.KVEventBatch).decode(encode_batch(records))
        assert isinstance(batch.events[0], peer.AllBlocksCleared)
        removed = batch.events[1:]
        assert all(isinstance(e, peer.BlockRemoved) and e.medium == "CPU_PINNED" for e in removed)
        assert {h for e in removed for h in e.block_hashes} == host
        mirror.apply(1, decode_batch(encode_batch(records)))
        assert mirror.blocks == set() and mirror.media == {"cpu": set(), "disk": disk} == _tier_blocks(tiers)
    finally:
        engine.close(30)
