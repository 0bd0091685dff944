"""Structural checks and printing for BlockHashCache, kept out of the cache's hot module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.core.key import ROOT_HASH, chain_hash

if TYPE_CHECKING:
    from radixserve.cache.baselines.block import BlockHashCache


def check_block_invariants(cache: BlockHashCache) -> None:
    """Recompute every counter and link by brute force (O(blocks)); AssertionError on a mismatch."""
    size, blocks, queue = cache.block_size, cache._blocks, cache._free_queue
    known = {ROOT_HASH: True}  # hash -> every ancestor resident (missing hashes: False)
    sizes, child_refs = [0, 0, 0], dict.fromkeys(blocks, 0)  # evictable, protected, unreachable
    for block_hash, block in blocks.items():
        assert block.hash == block_hash and len(block.slots) == len(block.token_ids) == size, f"{block!r}"
        assert chain_hash(block.parent_hash, block.extra_key, block.token_ids) == block_hash, f"{block!r}: hash"
        assert block_hash in cache._children.get(block.parent_hash, ()), f"{block!r} missing from its parent's set"
        assert (block.ref_cnt == 0) == (queue.get(block_hash) is block) and block.ref_cnt >= 0, f"{block!r}: queue"
        parent = blocks.get(block.parent_hash)
        if parent is not None:
            assert parent.extra_key == block.extra_key and parent.start + size == block.start, f"{block!r}"
            child_refs[parent.hash] += block.ref_cnt
        else:
            assert block.ref_cnt == 0 or block.parent_hash == ROOT_HASH, f"locked {block!r} lost its parent"
            assert block.start > 0 or block.parent_hash == ROOT_HASH, f"{block!r}: start"
        chain, cursor = [], block_hash
        while cursor not in known:
            if cursor in blocks:
                chain.append(cursor)
                cursor = blocks[cursor].parent_hash
            else:
                known[cursor] = False
        known.update(dict.fromkeys(chain, known[cursor]))
        assert block.reachable == known[block_hash], f"{block!r}: stale reachable flag"
        sizes[block.ref_cnt > 0] += size
        sizes[2] += 0 if block.reachable else size
    for block_hash, refs in child_refs.items():
        assert blocks[block_hash].ref_cnt >= refs, f"{blocks[block_hash]!r}: ref_cnt below its children's ({refs})"
    assert len(queue) == sizes[0] // size, "free queue holds a block with ref_cnt > 0"
    assert sum(map(len, cache._children.values())) == len(blocks) and all(cache._children.values())
    assert sizes == [cache._evictable_size, cache._protected_size, cache._unreachable_size], f"sizes {sizes}"
    if cache.tail_first_release:  # the discipline: descendants always sit before ancestors
        position = {block_hash: i for i, block_hash in enumerate(queue)}
        assert all(position.get(b.parent_hash, i + 1) > i for i, b in enumerate(queue.values())), "queue order"
        assert cache._unreachable_size == 0, "tail-first release stranded a block"
    slots = cache.cached_slots()
    assert len(np.unique(slots)) == len(slots), "a KV slot is held by two blocks"
    assert not cache.allocator.is_free(slots).any(), "a cached slot is also on the free list"


def format_blocks(cache: BlockHashCache) -> str:
    """One line per block, reachable ones first, by position."""
    lines = [
        f"evictable={cache._evictable_size} protected={cache._protected_size} unreachable={cache._unreachable_size}"
    ]
    for b in sorted(cache._blocks.values(), key=lambda b: (not b.reachable, b.start)):
        ns, mark = f" ns={b.extra_key!r}" * (b.extra_key is not None), " UNREACHABLE" * (not b.reachable)
        lines.append(
            f"{b.hash.hex()[:8]}<-{b.parent_hash.hex()[:8]} @{b.start} {b.token_ids[:8].tolist()} "
            f"r={b.ref_cnt}{ns}{mark}"
        )
    return "\n".join(lines)
