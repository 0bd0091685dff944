"""KV events on the wire: the format vLLM and SGLang publish, so the routers built for them read ours.

One message per batch, three ZMQ frames: ``[topic, seq, payload]``. ``seq``
counts batches from 0 with no gaps, as 8 bytes big-endian; ``payload`` is a
msgpack ``KVEventBatch``, an array ``[ts, events, data_parallel_rank]`` whose
events are tagged maps (``"type"`` is the class name):

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": B, "lora_id": None, "medium": None, "lora_name": None,
     "namespace": ns | None, "shared_len": s}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": None}
    {"type": "AllBlocksCleared"}

``namespace`` and ``shared_len`` are ours: a peer decoder skips keys it does
not know. ``medium`` says which store holds the block: None for the KV pool (what
every router reads as the device), ``"CPU_PINNED"`` / ``"DISK"`` for the host and
disk cache tiers (``--hicache-size``, ``--cache-dir``): SGLang's ``StorageMedium``
names, which SGLang's router matches exactly and NVIDIA Dynamo's KV router takes as
its canonical names (``WIRE_MEDIA``; ``tier_of`` reads every spelling a publisher
uses, vLLM's ``"GPU"`` / ``"CPU"`` / ``"STORAGE"`` included). A tier announces
every page it gains (copied from the pool, spilled from L2 to L3, prefetched from
L3 into L2) as a ``BlockStored`` with its parent hash and tokens, as vLLM's
self-describing offloading events do, and every page it drops as a ``BlockRemoved``;
both at each publish and only if the tier's state then differs from what was
announced, so a consumer that keeps one set per medium holds exactly what each
tier holds. Pages already on disk at a start are announced at once, in full (a
page file keeps its parent and tokens), each after its parent where both are on
disk. A version 1 file keeps neither: its page goes out in vLLM's placeholder
form (``parent_block_hash`` None, ``token_ids`` empty, ``block_size`` 0) and is
announced again in full once a request reads it. Tier events go out only when
``B`` is the tier page (16 tokens for cache pages up to 16: the default), as a
tier page's hash is a block hash at that size only. ``AllBlocksCleared`` clears
the pool, as vLLM's block pool sends it; a tier announces its own removals (after
it, in the same batch: the host's and, unless the flush keeps it, the disk's). ``BlockMirror`` (mirror.py)
keeps one set per medium.

Blocks are whole runs of ``B`` tokens (16 by default, whatever the cache's page
size), announced once all their tokens are cached and removed as soon as one is
evicted. A hash is the first 8 bytes, as a signed big-endian
int64, of the chained 16-byte page hash of ``radixserve.cache.core.key.page_hashes``:

    c_-1 = 16 zero bytes
    c_i  = blake2b(c_{i-1} || tag_i || int64-LE tokens of block i, digest_size=16)
    tag_i = ff ff ff ff if block i starts before shared_len, else len(ns) as 4 bytes LE || ns (UTF-8)
    h_i  = int.from_bytes(c_i[:8], "big", signed=True)

``namespace`` is the cache namespace: a hash already (server/tenancy.py), never a raw salt.
"""

from __future__ import annotations

import itertools
import time

import msgspec

from radixserve.cache import KVEvent, PageLabel, RadixKey

END_SEQ = -1  # the seq frame of the message that ends a replay (empty topic and payload)
SNAPSHOT = b"snapshot"  # our addition on the replay socket: a request body, and the topic frame of its answer

# Our tiers' names on the wire: SGLang's StorageMedium values, the spelling SGLang's router matches (an unknown
# medium's store is dropped there, its removal clears every tier) and Dynamo's KV router writes as canonical.
WIRE_MEDIA: dict[str, str] = {"cpu": "CPU_PINNED", "disk": "DISK"}
# Every spelling publishers use (vLLM: GPU / CPU / STORAGE; SGLang: GPU / CPU_PINNED / DISK; Dynamo's aliases;
# radixserve before this table: cpu / disk), upper-cased, to our tier name; None is the KV pool.
MEDIUM_ALIASES: dict[str, str | None] = {
    "GPU": None,
    "DEVICE": None,
    "CPU": "cpu",
    "CPU_PINNED": "cpu",
    "CPU_TIER1": "cpu",
    "DISK": "disk",
    "STORAGE": "disk",
    "NVME": "disk",
    "CPU_TIER2": "disk",
}


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # vLLM's decoder requires the key, even when empty
    medium: str | None = None  # None: the engine's KV pool; else a cache tier (``WIRE_MEDIA``)
    lora_name: str | None = None
    namespace: str | None = None
    shared_len: int = 0
    kv_cache_dtype: str | None = None  # the pool's KV dtype (int8, bfloat16, ...): pages of two dtypes differ


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def wire_medium(tier: str | None) -> str | None:
    """The ``medium`` a cache event's tier (None: the pool; ``"cpu"`` / ``"disk"``) goes on the wire as."""
    return None if tier is None else WIRE_MEDIA.get(tier, tier)


def tier_of(medium: str | None) -> str | None:
    """Our name for the store a wire ``medium`` names, in any publisher's spelling and case: None (the KV pool),
    ``"cpu"``, ``"disk"``, or an unknown medium as sent (kept apart: never read as the pool)."""
    return None if medium is None else MEDIUM_ALIASES.get(medium.upper(), medium)


def wire_hash(digest: bytes) -> int:
    """A chained page hash as it goes on the wire: its first 8 bytes, a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def block_hashes(key: RadixKey, block_size: int) -> list[int]:
    """The wire hashes of every whole block of ``key`` (what a router computes for a prompt)."""
    return [wire_hash(d) for d in key.page_hashes(block_size)]


def event_record(event: KVEvent, block_size: int) -> WireEvent | None:
    """One cache event as a wire event at ``block_size`` (None if it covers no whole block)."""
    if event.kind == "clear":
        return AllBlocksCleared()
    if event.page_hash is not None:  # one tier page: its hash is a wire hash only at its own size
        if event.page_size != block_size:
            return None
        if event.kind == "remove":
            return BlockRemoved([wire_hash(event.page_hash)], medium=wire_medium(event.medium))
        if event.label is None:  # found at a start in a version 1 file, which keeps no tokens: vLLM's placeholder
            return BlockStored([wire_hash(event.page_hash)], None, [], 0, medium=wire_medium(event.medium))
        return page_record(event.page_hash, event.label, event.medium)
    first = event.start // block_size
    # The chain up to the event's end: its tail is the event's blocks, the one before is their parent.
    chain = list(itertools.islice(event.key.page_hashes(block_size), max(first - 1, 0), None))
    hashes = [wire_hash(d) for d in (chain[1:] if first > 0 else chain)]
    if not hashes:
        return None
    if event.kind == "remove":
        return BlockRemoved(hashes, medium=wire_medium(event.medium))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=wire_hash(chain[0]) if first > 0 else None,
        token_ids=event.key.token_ids[first * block_size : (first + len(hashes)) * block_size].tolist(),
        block_size=block_size,
        namespace=event.key.extra_key,
        shared_len=event.key.shared_len,
        medium=wire_medium(event.medium),
    )


def page_record(page_hash: bytes, label: PageLabel, medium: str | None) -> BlockStored:
    """One tier page stored, as complete as a pool block's record (parent, tokens, namespace)."""
    return BlockStored(
        block_hashes=[wire_hash(page_hash)],
        parent_block_hash=wire_hash(label.parent_hash) if label.parent_hash is not None else None,
        token_ids=label.token_ids.tolist(),
        block_size=len(label.token_ids),
        namespace=label.extra_key,
        shared_len=label.shared_len,
        medium=wire_medium(medium),
    )


def encode_batch(events: list[WireEvent], ts: float | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(time.time() if ts is None else ts, events))


def decode_batch(data: bytes) -> KVEventBatch:
    """A batch from its payload frame (``msgspec.ValidationError`` / ``DecodeError`` if it is not one)."""
    return _decoder.decode(data)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a seq frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
