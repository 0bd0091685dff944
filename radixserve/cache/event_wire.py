"""KV events on the wire: batches a router outside the process can decode, and a mirror it keeps.

A batch is msgpack: ``{"seq": n, "ts": unix seconds, "events": [...]}``, seq
counting batches from 1 with no gaps. Events, in vLLM's vocabulary:

    {"type": "stored",  "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": B, "namespace": ns | None, "shared_len": s}
    {"type": "removed", "block_hashes": [h, ...]}
    {"type": "cleared"}

Blocks are whole runs of ``B`` tokens (the publisher's block size, 16 by
default, whatever the cache's page size); a block is announced once all its
tokens are cached and removed as soon as any of them is evicted. Block hashes
are reproducible from token ids alone (``radixserve.cache.key.page_hashes``):

    h_0 = 16 zero bytes
    h_i = blake2b(h_{i-1} || tag || int64-LE tokens of block i, digest_size=16)
    tag = b"\\xff\\xff\\xff\\xff" in the shared namespace, else len(ns) as 4 bytes LE || ns (UTF-8)

where blocks starting before ``shared_len`` use the shared tag. ``namespace`` is
the cache namespace: a hash already (see server/tenancy.py), never a raw salt.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack

from radixserve.cache.events import KVEvent
from radixserve.cache.key import ROOT_HASH, page_hashes


def event_record(event: KVEvent, block_size: int) -> dict[str, Any] | None:
    """One cache event as a wire record at ``block_size`` (None if it covers no whole block)."""
    if event.kind == "clear":
        return {"type": "cleared"}
    first = event.start // block_size
    hashes = list(
        itertools.islice(
            page_hashes(event.prefix[: event.end], event.extra_key, block_size, shared_len=event.shared_len),
            first,
            None,
        )
    )
    if not hashes:
        return None
    if event.kind == "remove":
        return {"type": "removed", "block_hashes": hashes}
    parent = (
        ROOT_HASH
        if first == 0
        else next(
            itertools.islice(
                page_hashes(
                    event.prefix[: first * block_size], event.extra_key, block_size, shared_len=event.shared_len
                ),
                first - 1,
                None,
            )
        )
    )
    return {
        "type": "stored",
        "block_hashes": hashes,
        "parent_block_hash": None if first == 0 else parent,
        "token_ids": event.prefix[first * block_size : (first + len(hashes)) * block_size].tolist(),
        "block_size": block_size,
        "namespace": event.extra_key,
        "shared_len": event.shared_len,
    }


def encode_batch(seq: int, records: list[dict[str, Any]], ts: float | None = None) -> bytes:
    return bytes(msgpack.packb({"seq": seq, "ts": time.time() if ts is None else ts, "events": records}))


def decode_batch(data: bytes) -> dict[str, Any]:
    batch = msgpack.unpackb(data)
    if not isinstance(batch, dict) or not isinstance(batch.get("seq"), int):
        raise ValueError("not a KV event batch")
    return batch


class BlockMirror:
    """The set of cached block hashes, rebuilt from batches (or a snapshot) in seq order."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.seq = 0  # the last batch applied

    def apply(self, batch: dict[str, Any]) -> None:
        if batch["seq"] != self.seq + 1:
            raise ValueError(f"batch {batch['seq']} after {self.seq}: events were missed (replay or snapshot)")
        for record in batch["events"]:
            if record["type"] == "stored":
                self.blocks.update(record["block_hashes"])
            elif record["type"] == "removed":
                self.blocks.difference_update(record["block_hashes"])
            elif record["type"] == "cleared":
                self.blocks.clear()
        self.seq = batch["seq"]

    def load_snapshot(self, seq: int, blocks: list[bytes]) -> None:
        self.blocks, self.seq = set(blocks), seq
