"""KV events: a subscriber outside the engine rebuilds exactly the set of cached blocks.

The engine serves a random shared-prefix workload in a pool small enough to
evict; after every step the publisher sends the drained events. The subscriber
joins late (it misses the first batches: a replay fills the gap), or after the
replay ring has moved on (a snapshot rebuilds it). At the end its mirror must
equal the blocks recomputed from the cache's tree and token ids alone.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from radixserve import Engine
from radixserve.cache import RadixCache, RadixKey
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.kv_events.subscriber import KVEventSubscriber
from radixserve.kv_events.wire import block_hashes

BLOCK = 16


def expected_blocks(cache: RadixCache) -> set[int]:
    """Every whole block on every cached path, hashed from the tokens (the documented recipe)."""
    blocks: set[int] = set()
    for node in cache.nodes():
        if not node.children:
            blocks.update(block_hashes(cache.path_key(node), BLOCK))
    return blocks


def workload(seed: int, n: int = 40) -> list[tuple[list[int], str | None]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 128, 40).tolist() for _ in range(4)]
    out = []
    for _ in range(n):
        prefix = prefixes[int(rng.integers(4))][: int(rng.integers(8, 41))]
        out.append(
            (prefix + rng.integers(3, 128, int(rng.integers(1, 30))).tolist(), [None, "ns-a"][int(rng.integers(2))])
        )
    return out


def serve_and_publish(
    engine: Engine,
    publisher: KVEventPublisher,
    requests: list[tuple[list[int], str | None]],
    before: int = 0,
    on_batch: object = None,
) -> None:
    for prompt, ns in requests:
        engine.scheduler.add(engine.make_request(prompt, {"max_new_tokens": 6, "ignore_eos": True}, ns))
    while engine.scheduler.has_work():
        engine.step()
        assert engine.cache.events is not None
        publisher.publish(engine.cache.events.drain())


def drain(subscriber: KVEventSubscriber, publisher: KVEventPublisher) -> None:
    deadline = time.monotonic() + 10
    while subscriber.mirror.seq < publisher.seq and time.monotonic() < deadline:
        subscriber.poll(50)
    if subscriber.mirror.seq < publisher.seq:
        subscriber.catch_up()  # the last batches can be lost to a slow-joining SUB socket


@pytest.fixture
def endpoints(tmp_path: Path) -> Iterator[tuple[str, str]]:
    yield f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv.replay"


@pytest.mark.parametrize("buffer,expect", [(10_000, "replay"), (2, "snapshot")])
def test_a_late_subscriber_rebuilds_exactly_the_cached_blocks(
    tiny_model_dir: Path, endpoints: tuple[str, str], buffer: int, expect: str
) -> None:
    engine = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=512, enable_kv_events=True)
    publisher = KVEventPublisher(*endpoints, block_size=BLOCK, buffer=buffer)
    try:
        serve_and_publish(engine, publisher, workload(1))  # nobody listens yet
        assert publisher.seq > 1
        subscriber = KVEventSubscriber(*endpoints)
        time.sleep(0.2)  # let the subscription reach the publisher
        serve_and_publish(engine, publisher, workload(2))
        drain(subscriber, publisher)
        assert engine.cache.evicted_tokens > 0  # the pool was under pressure: removals happened
        assert subscriber.mirror.seq == publisher.seq
        assert subscriber.blocks == expected_blocks(engine.cache)  # type: ignore[arg-type]
        assert (subscriber.replays if expect == "replay" else subscriber.snapshots) >= 1
        engine.flush_cache()
        publisher.publish(engine.cache.events.drain())  # type: ignore[union-attr]
        drain(subscriber, publisher)
        assert subscriber.blocks == set()  # the clear event
        subscriber.close()
    finally:
        publisher.close()


def test_a_bad_replay_request_gets_an_error_not_a_dead_thread(endpoints: tuple[str, str]) -> None:
    publisher = KVEventPublisher(*endpoints)
    try:
        subscriber = KVEventSubscriber(*endpoints)
        with pytest.raises(RuntimeError, match="refused"):
            list(subscriber._request(b"what?"))  # neither a seq nor b"snapshot"
        assert list(subscriber._request(b"\x00" * 8)) == []  # nothing to replay: only the end message
        subscriber.snapshot()  # the thread still answers
        assert subscriber.mirror.seq == -1 and subscriber.blocks == set()
        subscriber.close()
    finally:
        publisher.close()


def test_the_server_publishes_blocks_a_router_recomputes_from_token_ids(tiny_model_dir: Path) -> None:
    import httpx

    from tests.support.server_process import ServerProcess, free_port

    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = ServerProcess(
        "--kv-events-endpoint",
        pub,
        "--kv-events-replay-endpoint",
        rep,
        "--log-level",
        "warning",
        model_path=tiny_model_dir,
    ).start()
    try:
        subscriber = KVEventSubscriber(pub, rep)
        prompt = list(range(10, 50))  # 40 tokens: blocks 0 and 1 are whole
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(proc.url + "/generate", json=body, timeout=60).status_code == 200
        subscriber.poll(500)
        subscriber.catch_up()  # whatever the SUB socket missed while joining
        wanted = block_hashes(RadixKey(prompt), BLOCK)
        assert set(wanted) <= subscriber.blocks
        assert httpx.post(proc.url + "/flush_cache", timeout=30).status_code == 200
        time.sleep(0.6)  # the scheduler publishes within its 0.5 s idle wait
        subscriber.poll(500)
        subscriber.catch_up()
        assert subscriber.blocks == set()
        subscriber.close()
    finally:
        assert proc.stop() == 0


def test_server_args_built_without_flags_publish_on_their_endpoint(
    tiny_model_dir: Path, endpoints: tuple[str, str]
) -> None:
    """The Ray path and tests build ServerArgs directly: an endpoint alone is enough (no second switch to forget)."""
    from radixserve.engine import EngineConfig
    from radixserve.engine.driver import Delta
    from radixserve.server.app import create_app
    from radixserve.server.args import ServerArgs

    engine_config = EngineConfig(model_path=str(tiny_model_dir), max_total_tokens=512)
    args = ServerArgs(engine=engine_config, kv_events_endpoint=endpoints[0], kv_events_replay_endpoint=endpoints[1])
    engine = Engine(args.engine)
    worker = create_app(engine, args).state.radixserve.worker
    worker.start()
    try:
        deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        worker.reserve(1)
        worker.submit(engine.make_request(list(range(10, 50)), {"max_new_tokens": 2}), deltas.put)
        while deltas.get(timeout=60).result is None:
            pass
        assert worker.events is not None
        assert worker.call(lambda: worker.events.seq).result(60) >= 0  # a first batch went out (-1: none)
    finally:
        worker.stop()
        if worker.events is not None:
            worker.events.close()


def test_a_routers_mirror_of_every_tier_ends_empty_after_an_http_flush(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With a host tier and a cache directory (write-through: each prompt page lands in all three), a subscriber
    mirrors the pool, ``cpu`` and ``disk``; after ``POST /flush_cache`` every one of them is empty."""
    import httpx

    from tests.support.server_process import ServerProcess, free_port

    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    flags = ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep, "--hicache-size", "0.01"]
    flags += ["--hicache-write-policy", "write_through", "--cache-dir", str(tmp_path / "kv"), "--log-level", "warning"]
    proc = ServerProcess(*flags, model_path=tiny_model_dir).start()
    try:
        subscriber = KVEventSubscriber(pub, rep)
        body = {"input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(proc.url + "/generate", json=body, timeout=60).status_code == 200

        def caught_up() -> None:
            time.sleep(0.6)  # the scheduler publishes within its 0.5 s idle wait (the disk writer's too)
            subscriber.poll(500)
            subscriber.catch_up()

        deadline = time.monotonic() + 60
        while not (subscriber.media.get("cpu") and subscriber.media.get("disk")) and time.monotonic() < deadline:
            caught_up()
        assert subscriber.blocks and subscriber.media["cpu"] and subscriber.media["disk"]
        assert httpx.post(proc.url + "/flush_cache", timeout=30).status_code == 200
        caught_up()
        assert subscriber.blocks == set() and all(not held for held in subscriber.media.values())
        subscriber.close()
    finally:
        assert proc.stop() == 0
