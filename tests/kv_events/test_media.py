"""Every medium reaches a subscriber: the snapshot covers each tier, a restart announces its disk, and the medium
names are the ones the routers match (SGLang's StorageMedium), read back in any publisher's spelling."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from radixserve.cache import KVEventLog, RadixCache, RadixKey
from radixserve.cache.tiers.disk_store import DiskPageStore
from radixserve.cache.tiers.host_arena import HostArena
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import PoolPageMover
from radixserve.kv_events.mirror import SNAPSHOT_V2
from radixserve.kv_events.publisher import Frames, KVEventPublisher
from radixserve.kv_events.subscriber import KVEventSubscriber
from radixserve.kv_events.wire import SNAPSHOT, WIRE_MEDIA, block_hashes, tier_of, wire_hash
from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool
from tests.kv_events.peers import peer_kv_events
from tests.kv_events.test_peer_decoders import PEERS, wait_for
from tests.kv_events.test_tier_medium import PAGE_BYTES, _cached_and_evicted, _tier_blocks
from tests.server.test_kv_events import drain
from tests.support.server_process import ServerProcess, free_port

KEPT = np.arange(200, 232, dtype=np.int64)  # two blocks left in the pool


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[tuple[RadixCache, KVEventPublisher]]:
    """A cache whose 2-page L2 spills to disk, after three 3-page prompts went down the tiers and one stayed in
    the pool; every drain published, with a replay buffer of 2 batches (a subscriber joining now needs a snapshot)."""
    events = KVEventLog(1)
    disk = DiskPageStore(tmp_path / "kv", 1 << 20, {"model": "test"})
    tiers = TierIndex(PoolPageMover(KVPool(1, 49, 1, 2), 16), 16, HostArena(2 * PAGE_BYTES), disk, events=events)
    cache = RadixCache(TokenAllocator(48), 1, listeners=[events], tiers=tiers)
    publisher = KVEventPublisher(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/ev.replay", block_size=16, buffer=2)
    assert cache.events is not None
    try:
        for start in (3, 60, 120):
            _cached_and_evicted(cache, np.arange(start, start + 48, dtype=np.int64))
            assert disk.flush(60)
            publisher.publish(cache.events.drain())
        req = cache.open_request(RadixKey(KEPT))
        assert cache.extend_request(req, KEPT)
        cache.cache_finished_req(req)
        publisher.publish(cache.events.drain())
        assert publisher.seq > 2
        yield cache, publisher
    finally:
        publisher.close()
        cache.tiers.close(5)


def test_a_late_subscriber_starts_with_every_tier_from_the_snapshot(
    tiered: tuple[RadixCache, KVEventPublisher],
) -> None:
    cache, publisher = tiered
    assert cache.tiers is not None and cache.events is not None
    subscriber = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        subscriber.catch_up()  # the replay buffer no longer reaches batch 0: a snapshot
        assert subscriber.snapshots == 1 and subscriber.mirror.seq == publisher.seq
        tiers = _tier_blocks(cache.tiers)
        assert tiers["cpu"] and tiers["disk"]  # pages moved to L2 and on to L3
        assert subscriber.media == tiers
        assert subscriber.blocks == set(block_hashes(RadixKey(KEPT), 16))
        time.sleep(0.2)  # let the subscription reach the publisher
        _cached_and_evicted(cache, np.arange(300, 348, dtype=np.int64))  # and it follows live from there
        assert cache.tiers.disk is not None and cache.tiers.disk.flush(60)
        publisher.publish(cache.events.drain())
        drain(subscriber, publisher)
        assert subscriber.media == _tier_blocks(cache.tiers) != tiers
    finally:
        subscriber.close()


class PublisherBeforeV2(KVEventPublisher):
    """Answers as the publisher did before snapshot v2: a body it does not know is read as a seq, and refused."""

    def _answer(self, request: Frames) -> list[Frames]:
        if request[1:] == [SNAPSHOT_V2]:
            raise ValueError(f"a seq frame is 8 bytes, got {len(SNAPSHOT_V2)}")
        return super()._answer(request)


def test_the_v1_snapshot_is_unchanged_and_a_new_subscriber_reads_an_old_publisher(
    tiered: tuple[RadixCache, KVEventPublisher], tmp_path: Path
) -> None:
    cache, publisher = tiered
    subscriber = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:  # a client that knows only v1: one answer under the v1 topic, the pool's hashes as a msgpack array
        ((topic, seq, data),) = list(subscriber._request(SNAPSHOT))
        assert (topic, seq) == (SNAPSHOT, publisher.seq)
        assert msgspec.msgpack.decode(data, type=list[int]) == sorted(block_hashes(RadixKey(KEPT), 16))
    finally:
        subscriber.close()
    old = PublisherBeforeV2(f"ipc://{tmp_path}/old", block_size=16)
    assert cache.events is not None
    try:
        tokens = np.arange(400, 416, dtype=np.int64)  # one block more in the pool; then one page to L2
        req = cache.open_request(RadixKey(tokens))
        assert cache.extend_request(req, tokens)
        cache.cache_finished_req(req)
        cache.evict(16)
        old.publish(cache.events.drain())
        assert old._mirror.media["cpu"]  # it knows an L2 page, but its v1 snapshot cannot say so
        subscriber = KVEventSubscriber(old.endpoint, old.replay_endpoint)
        subscriber.snapshot()  # v2 refused: v1, the pool; the tiers' mirrors start empty
        assert subscriber.snapshots == 1 and subscriber.mirror.seq == 0
        assert subscriber.blocks == old._mirror.blocks and len(subscriber.blocks) == 1
        assert subscriber.media == {"cpu": set(), "disk": set()}
        subscriber.close()
    finally:
        old.close()


def test_our_media_are_the_names_sglangs_router_matches() -> None:
    """SGLang's router matches StorageMedium's values exactly (it drops a store on any other medium, and a removal
    on one clears every tier); Dynamo's KV router takes them as canonical too."""
    sglang = peer_kv_events("sglang")
    values = {medium.value for medium in sglang.StorageMedium}
    assert WIRE_MEDIA == {"cpu": "CPU_PINNED", "disk": "DISK"} and set(WIRE_MEDIA.values()) <= values
    assert [tier_of(v) for v in ("GPU", "CPU_PINNED", "DISK")] == [None, "cpu", "disk"]


@PEERS
def test_our_subscriber_reads_each_medium_in_the_peers_own_spelling(tmp_path: Path, peer: str) -> None:
    module = peer_kv_events(peer)
    if peer == "vllm":  # its block pool, CPU offloading and storage tiers
        gpu, cpu, disk = module.MEDIUM_GPU, module.MEDIUM_CPU, module.MEDIUM_STORAGE
    else:
        gpu, cpu, disk = (module.StorageMedium[m].value for m in ("GPU", "CPU", "DISK"))
    rank = {"sglang": "attn_dp_rank", "vllm": "data_parallel_rank"}[peer]
    publisher = module.ZmqEventPublisher(
        **{rank: 0}, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/rep", topic="t"
    )

    def stored(hashes: list[int], medium: str) -> object:
        tokens = list(range(16 * len(hashes)))
        return module.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=tokens,
            block_size=16,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    events = [stored([1, 2], gpu), stored([1, 3], cpu), stored([4], disk), module.BlockRemoved([1], medium=cpu)]
    subscriber = KVEventSubscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep", topic="t")
    try:
        time.sleep(0.3)
        for event in events:
            publisher.publish(module.KVEventBatch(ts=time.time(), events=[event]))
        wait_for(lambda: (subscriber.poll(50), subscriber.mirror.seq == 3)[1], "the peer's batches")
        assert subscriber.blocks == {1, 2}  # the pool's, under the peer's "GPU" (a tier dropping 1 left it there)
        assert subscriber.media == {"cpu": {3}, "disk": {4}}
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_restarted_server_announces_its_disk_pages_before_any_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    import httpx

    flags = ("--cache-dir", str(tmp_path / "kv"), "--max-total-tokens", "512", "--log-level", "warning")
    with ServerProcess(*flags, model_path=tiny_model_dir) as first:
        body = {"input_ids": list(range(10, 90)), "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(first.url + "/generate", json=body, timeout=120).status_code == 200
    on_disk = {wire_hash(bytes.fromhex(path.stem)) for path in (tmp_path / "kv" / "pages").glob("*/*.kv")}
    assert len(on_disk) >= 5  # flushed at the graceful stop: 80 prompt tokens are five whole pages
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep)
    with ServerProcess(*flags, *events, model_path=tiny_model_dir):
        subscriber = KVEventSubscriber(pub, rep)
        try:  # the scheduler publishes what the start found within its first idle wait
            wait_for(lambda: (subscriber.catch_up(), subscriber.mirror.seq >= 0)[1], "the start's batch")
            assert subscriber.media == {"cpu": set(), "disk": on_disk} and subscriber.blocks == set()
            late = KVEventSubscriber(pub, rep)
            late.snapshot()
            assert late.media == subscriber.media
            late.close()
        finally:
            subscriber.close()
