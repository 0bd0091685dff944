"""Copies into a lower cache tier go on the wire as vLLM's ``medium``; the pool's mirror ignores them."""

from __future__ import annotations

import numpy as np

from radixserve.cache import RadixCache, RadixKey
from radixserve.cache.tiers import TierIndex
from radixserve.kv_events.wire import BlockMirror, BlockRemoved, BlockStored, decode_batch, encode_batch, event_record
from radixserve.memory import TokenAllocator
from radixserve.memory.host_arena import HostArena
from radixserve.memory.kv_pages import PoolPageMover
from radixserve.memory.kv_pool import KVPool


def test_demoted_blocks_carry_their_medium_and_leave_the_pool_mirror_exact() -> None:
    cache = RadixCache(TokenAllocator(32), 1, enable_kv_events=True)
    mover = PoolPageMover(KVPool(1, 33, 1, 2), 16)
    cache.tiers = TierIndex(mover, 16, HostArena(1 << 20), None)
    cache.tiers.events = cache.events
    assert cache.events is not None
    tokens = np.arange(3, 35, dtype=np.int64)  # two 16-token blocks
    req = cache.open_request(RadixKey(tokens))
    assert cache.extend_request(req, tokens)
    cache.cache_finished_req(req)
    cache.evict(32)
    records = [event_record(e, 16) for e in cache.events.drain()]
    wire = decode_batch(encode_batch([r for r in records if r is not None])).events
    stored = [e for e in wire if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == [None, "cpu", "cpu"]
    assert stored[1].block_hashes + stored[2].block_hashes == stored[0].block_hashes
    assert [e.medium for e in wire if isinstance(e, BlockRemoved)] == [None]
    mirror = BlockMirror()
    mirror.apply(0, decode_batch(encode_batch(wire)))
    assert mirror.blocks == set()  # the pool holds nothing now; the host tier's copies are not the pool's
