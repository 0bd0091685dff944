"""KV events for routers outside the process (``--kv-events-endpoint``): ZMQ PUB, replay, snapshot.

The scheduler thread drains the cache's event log after every step and
publishes one batch (``cache/event_wire.py``) as a 3-frame message: topic
``b"kv-events"``, seq (8 bytes, big-endian), msgpack payload. A subscriber that
sees a gap in seq asks the replay socket (REP, ``--kv-events-replay-endpoint``)
for ``{"op": "replay", "since": seq}`` and gets the missed batches from a ring
of the last ``buffer`` batches, or ``{"ok": false}`` when they are gone; then
(or when it starts late) ``{"op": "snapshot"}`` returns every cached block hash
as of a seq, from a mirror the publisher keeps by applying its own batches.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import msgpack
import zmq

from radixserve.cache.event_wire import BlockMirror, encode_batch, event_record
from radixserve.cache.events import KVEvent

logger = logging.getLogger(__name__)
TOPIC = b"kv-events"


def replay_endpoint_for(endpoint: str) -> str:
    """The default replay endpoint: the next TCP port (any free one for ``tcp://host:*``), or ``<path>.replay``."""
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        if port == "*":
            return endpoint
        if port.isdigit():
            return f"{host}:{int(port) + 1}"
    return endpoint + ".replay"


class KVEventPublisher:
    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, block_size: int = 16, buffer: int = 10_000
    ) -> None:
        self.block_size = block_size
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._rep = context.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(replay_endpoint or replay_endpoint_for(endpoint))
        # Where subscribers connect: the bound addresses (a ``tcp://host:*`` wildcard resolved to its port).
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._rep.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._mirror = BlockMirror()
        self._lock = threading.Lock()  # ring + mirror: the scheduler thread writes, the replay thread reads
        self._seq = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve_requests, name="radixserve-kv-replay", daemon=True)
        self._thread.start()

    @property
    def seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVEvent]) -> None:
        """One batch for ``events`` (scheduler thread only: the PUB socket is not thread-safe)."""
        records = [r for r in (event_record(e, self.block_size) for e in events) if r is not None]
        if not records:
            return
        with self._lock:
            self._seq += 1
            data = encode_batch(self._seq, records)
            self._ring.append((self._seq, data))
            self._mirror.apply({"seq": self._seq, "events": records})
        self._pub.send_multipart([TOPIC, self._seq.to_bytes(8, "big"), data])

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self._pub.close()
        self._rep.close()

    def _serve_requests(self) -> None:
        poller = zmq.Poller()
        poller.register(self._rep, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(100):
                continue
            try:
                request = msgpack.unpackb(self._rep.recv())
                reply = self._answer(request if isinstance(request, dict) else {})
            except Exception as exc:  # a malformed request gets an error, never kills the thread
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self._rep.send(msgpack.packb(reply))

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if request.get("op") == "snapshot":
                return {"ok": True, "seq": self._mirror.seq, "blocks": sorted(self._mirror.blocks)}
            if request.get("op") == "replay" and isinstance(request.get("since"), int):
                since = request["since"]
                oldest = self._ring[0][0] if self._ring else self._seq + 1
                if since + 1 < oldest and since < self._seq:
                    return {"ok": False, "error": f"batches after {since} are gone (oldest kept: {oldest})"}
                return {"ok": True, "batches": [data for seq, data in self._ring if seq > since]}
        return {"ok": False, "error": "unknown request: send {'op': 'replay', 'since': n} or {'op': 'snapshot'}"}
