"""A router's side of KV events: subscribe, detect gaps, replay or snapshot, keep a mirror per medium.

It reads any publisher of the shared format (vLLM, SGLang, radixserve) live and
through the replay protocol, whatever its spelling of ``medium`` (mirror.py);
the snapshot it falls back on when a replay comes too late is radixserve's
addition (``publisher.py``): v2 (every medium) where the publisher answers it,
else v1 (the pool only; the tiers' mirrors then start empty).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import zmq

from radixserve.kv_events.mirror import SNAPSHOT_V2, BlockMirror, decode_snapshot
from radixserve.kv_events.wire import END_SEQ, SNAPSHOT, decode_batch, decode_seq, encode_seq

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
        """The KV pool's blocks (what routing on a device hit reads)."""
        return self.mirror.blocks

    @property
    def media(self) -> dict[str, set[int]]:
        """Each cache tier's blocks, by tier name (``"cpu"``, ``"disk"``)."""
        return self.mirror.media

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
        """Replace the mirror by the publisher's every cached block (radixserve publishers only).

        Asks for v2 (every medium) first; a publisher that predates it refuses, and v1 gives the pool.
        """
        answer = self._snapshot_answer(SNAPSHOT_V2)
        if answer is not None:
            self.mirror.load(answer[0], decode_snapshot(answer[1]))
        else:
            answer = self._snapshot_answer(SNAPSHOT)
            if answer is None:
                raise RuntimeError(f"{self._replay_endpoint} sent no snapshot")
            self.mirror.load_snapshot(answer[0], msgspec.msgpack.decode(answer[1], type=list[int]))
        self.snapshots += 1

    def _snapshot_answer(self, body: bytes) -> tuple[int, bytes] | None:
        """(seq, payload) of the answer to snapshot request ``body``; None if the publisher refused or lacks it."""
        try:
            messages = list(self._request(body))
        except RuntimeError:  # refused: not a request this publisher knows
            return None
        return next(((seq, data) for topic, seq, data in messages if topic == body), None)

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
