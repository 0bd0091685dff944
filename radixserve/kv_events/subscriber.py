"""A router's side of KV events: subscribe, detect gaps, replay or snapshot, keep a block mirror.

It reads any publisher of the shared format (vLLM, SGLang, radixserve) live and
through the replay protocol; the snapshot it falls back on when a replay comes
too late is radixserve's addition (``publisher.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import zmq

from radixserve.kv_events.wire import END_SEQ, SNAPSHOT, BlockMirror, decode_batch, decode_seq, encode_seq

Message = tuple[bytes, int, bytes]  # topic, seq, payload


class KVEventSubscriber:
    """Mirror one replica's cached blocks from its KV events endpoint and replay endpoint."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", timeout_ms: int = 5000) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint, self._timeout_ms = replay_endpoint, timeout_ms
        self.mirror = BlockMirror()
        self.replays = self.snapshots = 0

    @property
    def blocks(self) -> set[int]:
        return self.mirror.blocks

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The SUB socket (to poll many subscribers at once; use it from one thread only)."""
        return self._sub

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that arrived (waiting up to ``timeout_ms`` for the first); how many applied."""
        applied = 0
        while self._sub.poll(timeout_ms if applied == 0 else 0):
            _, seq_frame, data = self._sub.recv_multipart()
            seq = decode_seq(seq_frame)
            if seq <= self.mirror.seq:
                continue  # already have it (from a replay or a snapshot)
            if seq > self.mirror.seq + 1:
                self.catch_up()
            if seq == self.mirror.seq + 1:
                self.mirror.apply(seq, decode_batch(data))
            applied += 1
        return applied

    def catch_up(self) -> None:
        """Fetch what was missed: a replay if the publisher still has it, else a snapshot."""
        start = self.mirror.seq + 1
        replayed = list(self._request(encode_seq(start)))
        self.replays += 1
        if replayed and replayed[0][1] > start:  # the batches from `start` on have left the replay buffer
            self.snapshot()
            return
        for _, seq, data in replayed:
            if seq == self.mirror.seq + 1:
                self.mirror.apply(seq, decode_batch(data))

    def snapshot(self) -> None:
        """Replace the mirror by the publisher's every cached block (radixserve publishers only)."""
        for topic, seq, data in list(self._request(SNAPSHOT)):
            if topic == SNAPSHOT:
                self.mirror.load_snapshot(seq, msgspec.msgpack.decode(data, type=list[int]))
                self.snapshots += 1
                return
        raise RuntimeError(f"{self._replay_endpoint} sent no snapshot")

    def close(self) -> None:
        self._sub.close()

    def _request(self, body: bytes) -> Iterator[Message]:
        """Send one request to the replay socket; yield its answer's messages up to the end message."""
        # One DEALER per request: one that timed out may still receive a stale answer.
        dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart([b"", body])
            while True:
                if not dealer.poll(self._timeout_ms):
                    raise TimeoutError(f"no answer from {self._replay_endpoint} in {self._timeout_ms} ms")
                _, topic, seq_frame, data = dealer.recv_multipart()
                seq = decode_seq(seq_frame)
                if seq == END_SEQ and not topic:  # (a snapshot of nothing has seq -1 too, under its topic)
                    if data:
                        raise RuntimeError(f"{self._replay_endpoint} refused the request: {data.decode()}")
                    return
                yield topic, seq, data
        finally:
            dealer.close()
