"""Routers built for SGLang and vLLM read radixserve's KV events with the peer's own decoder and replay protocol.

A real server (HTTP on a port, its scheduler thread, the publisher from
``--kv-events-config``) serves a random workload in a pool small enough to
evict, in two cache namespaces. A router written against the peer's
``KVEventBatch`` joins after the first half (the gap is filled through SGLang's
replay protocol) and must end with exactly the blocks the engine's tree holds,
hashed from token ids by the documented recipe. A second one that never
subscribed rebuilds the same set from one replay. And the other way round:
radixserve's subscriber follows the peer's own publisher.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn

from radixserve.cache import RadixKey
from radixserve.engine import Engine
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.kv_events.subscriber import KVEventSubscriber
from radixserve.kv_events.wire import block_hashes
from radixserve.server.app import create_app
from radixserve.server.args import parse_args
from tests.kv_events.peers import PeerRouter, peer_kv_events
from tests.server.test_kv_events import expected_blocks
from tests.support.server_process import free_port

BLOCK = 16
TOPIC = "kv@radixserve"
PEERS = pytest.mark.parametrize("peer", ["sglang", "vllm"])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextmanager
def live_server(model: Path, *flags: str) -> Iterator[tuple[str, Engine, KVEventPublisher]]:
    """The server ``radixserve serve`` runs, on a thread of this process so the test can read its tree."""
    port = free_port()
    args = parse_args(["--model-path", str(model), "--port", str(port), "--log-level", "warning", *flags])
    engine = Engine(args.engine)
    app = create_app(engine, args)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the server to start")
    publisher = app.state.radixserve.worker.events
    assert publisher is not None
    try:
        yield f"http://127.0.0.1:{port}", engine, publisher
    finally:
        server.should_exit = True
        thread.join(60)


def send_workload(url: str, seed: int, n: int = 24) -> None:
    """Random prompts over four shared prefixes, in two namespaces, four at a time."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 128, 48).tolist() for _ in range(4)]
    bodies = []
    for _ in range(n):
        prompt = prefixes[int(rng.integers(4))][: int(rng.integers(10, 49))]
        prompt += rng.integers(3, 128, int(rng.integers(1, 40))).tolist()
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        if rng.integers(2):
            body["extra_key"] = "ns-a"
        bodies.append(body)
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(4) as pool:
        for response in pool.map(lambda b: client.post(url + "/generate", json=b), bodies):
            assert response.status_code == 200, response.text


def idle(url: str) -> bool:
    state = httpx.get(url + "/cache", timeout=30).json()
    return bool(state["running_requests"] == state["waiting_requests"] == 0)


@PEERS
def test_a_peer_router_follows_a_real_server_through_evictions_and_a_gap(tiny_model_dir: Path, peer: str) -> None:
    peer_module = peer_kv_events(peer)
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {"publisher": "zmq", "endpoint": pub, "replay_endpoint": rep, "topic": TOPIC}
    flags = ("--max-total-tokens", "512", "--kv-events-config", json.dumps(config))
    with live_server(tiny_model_dir, *flags) as (url, engine, publisher):
        send_workload(url, seed=1)  # no router listens yet
        wait_for(lambda: idle(url), "the first half to finish")
        assert publisher.seq > 2
        router = PeerRouter(peer_module, pub, rep, TOPIC)
        try:
            time.sleep(0.3)  # let the subscription reach the publisher (the gap itself is the point)
            send_workload(url, seed=2)
            wait_for(lambda: idle(url), "the second half to finish")
            wait_for(lambda: (router.poll(50), router.last_seq == publisher.seq)[1], "the router to catch up")
            assert engine.cache.evicted_tokens > 0  # the pool was under pressure: BlockRemoved happened
            assert router.replayed > 0  # the first half came through SGLang's replay protocol
            assert router.blocks == expected_blocks(engine.cache)  # type: ignore[arg-type]
            assert len({node.key.extra_key for node in engine.cache.nodes()}) == 2  # unsalted and ns-a

            late = PeerRouter(peer_module, pub, rep, TOPIC)  # never saw a live batch: one replay from 0
            late.replay(0)
            assert late.last_seq == publisher.seq and late.blocks == router.blocks
            late.close()

            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            wait_for(lambda: (router.poll(50), not router.blocks)[1], "AllBlocksCleared")
        finally:
            router.close()


@PEERS
def test_a_router_rebuilds_hashes_for_a_prompt_from_token_ids(tiny_model_dir: Path, peer: str) -> None:
    """What a router does to route: hash a prompt by the README's recipe and find it in the stored events."""
    peer_module = peer_kv_events(peer)
    pub = f"tcp://127.0.0.1:{free_port()}"
    with live_server(tiny_model_dir, "--kv-events-endpoint", pub) as (url, engine, publisher):
        router = PeerRouter(peer_module, pub, publisher.replay_endpoint)
        try:
            prompt = list(range(10, 50))  # 40 tokens: blocks 0 and 1 are whole
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
            wait_for(lambda: (router.poll(50), router.last_seq == publisher.seq)[1], "the stored event")
            assert set(block_hashes(RadixKey(prompt), BLOCK)) <= router.blocks
        finally:
            router.close()


@PEERS
def test_our_subscriber_follows_the_peers_own_publisher(tmp_path: Path, peer: str) -> None:
    """The other direction: radixserve's router reads an SGLang or vLLM server's stream, its replay included."""
    peer_module = peer_kv_events(peer)
    pub, rep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/rep"
    rank = {"sglang": "attn_dp_rank", "vllm": "data_parallel_rank"}[peer]
    publisher = peer_module.ZmqEventPublisher(**{rank: 0}, endpoint=pub, replay_endpoint=rep, topic="t")

    def batch(*events: object) -> object:
        return peer_module.KVEventBatch(ts=time.time(), events=list(events))

    try:
        stored = peer_module.BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium=None,
            lora_name=None,
        )
        publisher.publish(batch(stored))  # before anyone listens: seq 0
        wait_for(lambda: len(publisher._buffer) == 1, "the peer's publisher thread to send seq 0")
        subscriber = KVEventSubscriber(pub, rep, topic="t")
        time.sleep(0.3)
        publisher.publish(batch(peer_module.BlockRemoved(block_hashes=[2], medium=None)))
        wait_for(lambda: (subscriber.poll(50), subscriber.mirror.seq == 1)[1], "the peer's batches")
        assert subscriber.blocks == {1} and subscriber.replays == 1
        publisher.publish(batch(peer_module.AllBlocksCleared()))
        wait_for(lambda: (subscriber.poll(50), subscriber.mirror.seq == 2)[1], "the clear")
        assert subscriber.blocks == set()
        subscriber.close()
    finally:
        publisher.shutdown()


@pytest.mark.parametrize(
    "config,message",
    [
        ("{not json", "not JSON"),
        ('{"publisher": "zmq", "endpont": "tcp://*:5557"}', "unknown key 'endpont'"),
        ('{"endpoint": "tcp://*:5557"}', 'publisher "null"'),
        ('{"publisher": "kafka"}', "unknown publisher"),
        ('{"publisher": "zmq", "endpoint": "localhost:5557"}', "must start with"),
        ('{"publisher": "zmq", "buffer_steps": true}', "wrong type"),
        ('{"publisher": "zmq", "buffer_steps": 0}', "buffer_steps must be in 1.."),
        ('{"publisher": "zmq", "bind": false}', "bind must be true"),
        ('{"publisher": "zmq", "format": "dynamo"}', "not supported"),
        ("[1]", "JSON object"),
    ],
)
def test_a_bad_config_is_a_clear_error_at_start(config: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--kv-events-config", config])
    assert message in capsys.readouterr().err


def test_the_config_and_its_shorthand() -> None:
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv", "buffer_steps": 50}'
    args = parse_args(["--kv-events-config", config])
    assert args.engine.enable_kv_events and args.kv_events_endpoint == "tcp://*:6000"
    assert (args.kv_events_replay_endpoint, args.kv_events_topic, args.kv_events_buffer_steps) == (None, "kv", 50)
    short = parse_args(["--kv-events-endpoint", "tcp://127.0.0.1:6000"])
    assert short.kv_events_endpoint == "tcp://127.0.0.1:6000" and short.kv_events_topic == ""
    assert not parse_args([]).engine.enable_kv_events and parse_args([]).kv_events_endpoint is None
    with pytest.raises(SystemExit):
        parse_args(["--kv-events-config", config, "--kv-events-endpoint", "tcp://*:1"])
