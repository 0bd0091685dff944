"""KV events for routers outside the process: a ZMQ PUB socket and a ROUTER replay socket, as vLLM and SGLang.

The scheduler thread drains the cache's event log after every step and
publishes one batch (``wire.py``) as ``[topic, seq, payload]``. The replay
socket speaks their protocol: a client (REQ, or DEALER with an empty
delimiter frame) sends a starting seq as 8 bytes big-endian and gets every
kept batch from that seq on as ``[topic, seq, payload]`` (the last ``buffer``
batches are kept), then ``[b"", seq -1, b""]``. A client that asked for seq n
and gets a first batch after n knows the rest are gone.

Our addition, which their clients never send: a snapshot, from a mirror the
publisher keeps of its own batches (mirror.py), as of batch ``seq``, then the
same end message. The body ``b"snapshot"`` (v1, unchanged for the clients that
know it) answers ``[b"snapshot", seq, msgpack array of the KV pool's block
hashes]``; ``b"snapshot/2"`` answers ``[b"snapshot/2", seq, msgpack Snapshot]``,
every medium's hashes (the pool's and each cache tier's). A request that is none
of these gets the end message with an error text as its payload.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import msgspec
import zmq

from radixserve.cache import KVEvent
from radixserve.kv_events.config import replay_endpoint_for
from radixserve.kv_events.mirror import SNAPSHOT_V2, BlockMirror, encode_snapshot
from radixserve.kv_events.wire import (
    END_SEQ,
    SNAPSHOT,
    BlockStored,
    KVEventBatch,
    decode_seq,
    encode_batch,
    encode_seq,
    event_record,
)

logger = logging.getLogger(__name__)
Frames = list[bytes]


class KVEventsBindError(ValueError):
    """An endpoint could not be bound (a port in use, a missing ipc directory): the message says which and why."""


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        block_size: int = 16,
        buffer: int = 10_000,
        topic: str = "",
        hwm: int = 100_000,
    ) -> None:
        self.block_size, self.topic = block_size, topic
        self.kv_format: tuple[str, int] | None = None  # (KV dtype, tokens per GiB): describe_kv
        self._topic = topic.encode()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay = context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer + 1))  # a whole replay must fit: ROUTER drops past it
        self._bind(self._pub, "endpoint", endpoint)
        self._bind(self._replay, "replay endpoint", replay_endpoint or replay_endpoint_for(endpoint))
        # Where subscribers connect: the bound addresses (a ``tcp://host:*`` wildcard resolved to its port).
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._mirror = BlockMirror()
        self._lock = threading.Lock()  # ring + mirror: the scheduler thread writes, the replay thread reads
        self._seq = -1
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve_requests, name="radixserve-kv-replay", daemon=True)
        self._thread.start()

    def _bind(self, socket: zmq.Socket[bytes], name: str, endpoint: str) -> None:
        """Bind ``socket``; on failure close both sockets and raise KVEventsBindError naming the endpoint."""
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._pub.close()
            self._replay.close()
            raise KVEventsBindError(f"the KV events {name} {endpoint!r} cannot be bound: {exc}") from None

    @property
    def seq(self) -> int:
        """The last batch published (-1: none yet)."""
        return self._seq

    def describe_kv(self, kv_cache_dtype: str, tokens_per_gib: int) -> None:
        """The engine's KV pool, once it is built (the publisher opens before the model loads): every BlockStored
        then names the dtype, and a v2 snapshot both."""
        self.kv_format = (kv_cache_dtype, tokens_per_gib)

    def publish(self, events: list[KVEvent]) -> None:
        """One batch for ``events`` (scheduler thread only: the PUB socket is not thread-safe)."""
        records = [r for r in (event_record(e, self.block_size) for e in events) if r is not None]
        if not records:
            return
        if self.kv_format is not None:
            for record in records:
                if isinstance(record, BlockStored):
                    record.kv_cache_dtype = self.kv_format[0]
        data = encode_batch(records)
        with self._lock:
            self._seq += 1
            self._ring.append((self._seq, data))
            self._mirror.apply(self._seq, KVEventBatch(0.0, records))
        self._pub.send_multipart([self._topic, encode_seq(self._seq), data])

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self._pub.close()
        self._replay.close()

    def _serve_requests(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(100):
                continue
            frames = self._replay.recv_multipart()
            try:
                replies = self._answer(frames[1:])
            except Exception as exc:  # a malformed request gets an error, never kills the thread
                replies = [[b"", encode_seq(END_SEQ), f"{type(exc).__name__}: {exc}".encode()]]
            for reply in replies:
                self._replay.send_multipart([frames[0], b"", *reply])

    def _answer(self, request: Frames) -> list[Frames]:
        """The messages answering one request (after the client's identity), the end message last."""
        end = [b"", encode_seq(END_SEQ), b""]
        if len(request) != 2 or request[0] != b"":
            raise ValueError("a request is [b'', body]: a start seq (8 bytes big-endian), b'snapshot' or b'snapshot/2'")
        body = request[1]
        with self._lock:
            if body == SNAPSHOT:
                blocks = msgspec.msgpack.encode(sorted(self._mirror.blocks))
                return [[SNAPSHOT, encode_seq(self._mirror.seq), blocks], end]
            if body == SNAPSHOT_V2:
                snapshot = self._mirror.snapshot()
                if self.kv_format is not None:
                    snapshot.kv_cache_dtype, snapshot.kv_tokens_per_gib = self.kv_format
                return [[SNAPSHOT_V2, encode_seq(self._mirror.seq), encode_snapshot(snapshot)], end]
            start = decode_seq(body)
            return [[self._topic, encode_seq(seq), data] for seq, data in self._ring if seq >= start] + [end]
