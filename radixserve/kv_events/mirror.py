"""A router's copy of one replica's cache, per medium, from KV event batches or a snapshot.

``BlockMirror`` keeps one set of block hashes per store: ``blocks`` for the KV
pool (``medium`` None, or a peer's ``"GPU"``) and ``media[tier]`` for each lower
tier, under our tier name whatever the publisher's spelling (``wire.tier_of``:
``"cpu"`` for CPU / CPU_PINNED / cpu, ``"disk"`` for DISK / STORAGE / disk). A
tier's events never touch the pool's set: a tier dropping its copy never hides a
block the pool still holds. ``AllBlocksCleared`` clears the pool only (the tiers
announce their own removals).

The snapshot (our addition on the replay socket, see publisher.py) comes in two
versions. ``snapshot`` (v1, kept as it was for clients that know only it): the
pool's hashes, a msgpack array. ``snapshot/2``: a ``Snapshot`` map naming its
version and every medium's hashes, so a late subscriber starts with each tier too.
"""

from __future__ import annotations

import msgspec

from radixserve.kv_events.wire import AllBlocksCleared, BlockStored, KVEventBatch, tier_of, wire_medium

SNAPSHOT_V2 = b"snapshot/2"  # 10 bytes: a publisher that predates it refuses it (never reads it as an 8-byte seq)
SNAPSHOT_VERSION = 2
TIERS = ("cpu", "disk")  # radixserve's lower tiers: always in a snapshot, even when empty


class MediumBlocks(msgspec.Struct, gc=False):
    medium: str | None  # as in events: None for the KV pool, else the tier's wire name
    block_hashes: list[int]


class Snapshot(msgspec.Struct, gc=False):
    version: int
    media: list[MediumBlocks]
    kv_cache_dtype: str | None = None  # the publisher's KV pool, as its BlockStored events say (None: not told)
    kv_tokens_per_gib: int = 0


class BlockMirror:
    """Every medium's cached block hashes, rebuilt from batches (or a snapshot) in seq order."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()  # the KV pool's
        self.media: dict[str, set[int]] = {tier: set() for tier in TIERS}  # each lower tier's, by tier_of name
        self.seq = -1  # the last batch applied (-1: none)

    def holder(self, medium: str | None) -> set[int]:
        """The set a ``medium`` (any spelling) names: the pool's, a tier's (created for a medium not seen yet)."""
        tier = tier_of(medium)
        return self.blocks if tier is None else self.media.setdefault(tier, set())

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq != self.seq + 1:
            raise ValueError(f"batch {seq} after {self.seq}: events were missed (replay or snapshot)")
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                self.holder(event.medium).update(event.block_hashes)
            else:
                self.holder(event.medium).difference_update(event.block_hashes)
        self.seq = seq

    def load_snapshot(self, seq: int, blocks: list[int]) -> None:
        """A v1 snapshot (the pool only): the tiers' sets start empty, as nothing says what they hold."""
        self.blocks, self.seq = set(blocks), seq
        self.media = {tier: set() for tier in TIERS}

    def snapshot(self) -> Snapshot:
        """Every medium's blocks as a v2 snapshot answers them (sorted: the same state, the same bytes)."""
        media = [MediumBlocks(None, sorted(self.blocks))]
        media += [MediumBlocks(wire_medium(tier), sorted(blocks)) for tier, blocks in self.media.items()]
        return Snapshot(SNAPSHOT_VERSION, media)

    def load(self, seq: int, snapshot: Snapshot) -> None:
        """Replace every set by a v2 snapshot's (a medium it does not name is empty)."""
        self.blocks, self.seq = set(), seq
        self.media = {tier: set() for tier in TIERS}
        for entry in snapshot.media:
            self.holder(entry.medium).update(entry.block_hashes)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return msgspec.msgpack.encode(snapshot)


def decode_snapshot(data: bytes) -> Snapshot:
    """A v2 snapshot payload (``ValueError`` for a version this build does not read)."""
    snapshot = msgspec.msgpack.decode(data, type=Snapshot)
    if snapshot.version != SNAPSHOT_VERSION:
        raise ValueError(f"snapshot version {snapshot.version} (this subscriber reads {SNAPSHOT_VERSION})")
    return snapshot
