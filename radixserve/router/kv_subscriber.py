"""A router's side of KV events: subscribe, detect gaps, replay or snapshot, keep a block mirror."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from radixserve.cache.event_wire import BlockMirror, decode_batch

TOPIC = b"kv-events"


class KVEventSubscriber:
    """Mirror one replica's cached blocks from its ``--kv-events-endpoint``."""

    def __init__(self, endpoint: str, replay_endpoint: str, timeout_ms: int = 5000) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(endpoint)
        self._replay_endpoint, self._timeout_ms = replay_endpoint, timeout_ms
        self.mirror = BlockMirror()
        self.replays = self.snapshots = 0

    @property
    def blocks(self) -> set[bytes]:
        return self.mirror.blocks

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The SUB socket (to poll many subscribers at once; use it from one thread only)."""
        return self._sub

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that arrived (waiting up to ``timeout_ms`` for the first); how many applied."""
        applied = 0
        while self._sub.poll(timeout_ms if applied == 0 else 0):
            _, _, data = self._sub.recv_multipart()
            batch = decode_batch(data)
            if batch["seq"] <= self.mirror.seq:
                continue  # already have it (from a replay or a snapshot)
            if batch["seq"] > self.mirror.seq + 1:
                self.catch_up()
            if batch["seq"] == self.mirror.seq + 1:
                self.mirror.apply(batch)
            applied += 1
        return applied

    def catch_up(self) -> None:
        """Fetch what was missed: a replay if the publisher still has it, else a snapshot."""
        reply = self._request({"op": "replay", "since": self.mirror.seq})
        if reply.get("ok"):
            self.replays += 1
            for data in reply["batches"]:
                batch = decode_batch(data)
                if batch["seq"] == self.mirror.seq + 1:
                    self.mirror.apply(batch)
            return
        self.snapshot()

    def snapshot(self) -> None:
        reply = self._request({"op": "snapshot"})
        if not reply.get("ok"):
            raise RuntimeError(f"snapshot refused: {reply.get('error')}")
        self.snapshots += 1
        self.mirror.load_snapshot(reply["seq"], list(reply["blocks"]))

    def close(self) -> None:
        self._sub.close()

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        req: zmq.Socket[bytes] = zmq.Context.instance().socket(
            zmq.REQ
        )  # one per request: a timed-out REQ is stuck for good
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self._replay_endpoint)
        try:
            req.send(msgpack.packb(message))
            if not req.poll(self._timeout_ms):
                raise TimeoutError(f"no answer from {self._replay_endpoint} in {self._timeout_ms} ms")
            reply = msgpack.unpackb(req.recv())
            return reply if isinstance(reply, dict) else {"ok": False, "error": "malformed reply"}
        finally:
            req.close()
