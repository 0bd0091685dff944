"""BlockHashCache: the hash-block baseline (``--prefix-cache block``), vLLM-style.

A flat dict from block hash to block. A block is ``block_size`` tokens; its hash
chains its parent's hash, the namespace and its tokens (``chain_hash``), so one
hash names the whole prefix up to the block's end. There is no tree: a block
knows only its parent's hash, and the cache keeps, per parent hash, the set of
resident children (kept even while the parent itself is missing, so a
re-inserted parent finds its orphans).

Lookup hashes a key block by block and stops dead at the first missing block:
a resident block after a missing one is *unreachable*. It holds KV but can never
produce a hit until its ancestors are stored again. ``unreachable_size`` counts
such tokens, maintained incrementally (cost: the affected subtree).

Recency is the LRU free queue: every block with ``ref_cnt == 0`` in the order it
entered the queue; ``evict`` pops from the front. Releases go tail first (a
request's last block enters before its first), and ``insert`` re-enters every
unlocked block of its key the same way (a block another request cached
meanwhile must not sit before its new children), so descendants sit before
ancestors and eviction never strands a block. That is only call-site
discipline: ``tail_first_release=False`` releases head first and exists to
demonstrate the chapter's point, that an ancestor can then be evicted before
its descendants, leaving them resident but unreachable. The radix tree rules
this out by construction.

Never-cached slots are reused first by construction: they sit on the
allocator's free stack, and the engine evicts only when the allocator is short.

Slot ownership::

    insert(key, indices) -> n
    indices: |-- [0, n): caller's (already cached) --|-- [n, end): now the cache's --|
    a block past n that was resident (unreachable) takes the new slots; the cache
    frees its old ones itself, so the caller never frees anything past n.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from radixserve.cache.core.base import EMPTY_INDICES, BasePrefixCache, MatchResult
from radixserve.cache.core.key import ROOT_HASH, RadixKey, TokenArray, page_hashes
from radixserve.cache.core.listener import CacheListener
from radixserve.memory.allocator import IndexArray, TokenAllocator

Clock = Callable[[], float]


class Block:
    """One cached block: its tokens (``prefix[start:start+len(slots)]``), slots and hash."""

    __slots__ = ("hash", "parent_hash", "extra_key", "start", "prefix", "slots", "ref_cnt", "reachable")

    def __init__(
        self,
        block_hash: bytes,
        parent_hash: bytes,
        extra_key: str | None,
        start: int,
        prefix: TokenArray,
        slots: IndexArray,
    ) -> None:
        self.hash = block_hash
        self.parent_hash = parent_hash
        self.extra_key = extra_key
        self.start = start  # token position of the block's first token
        self.prefix = prefix  # tokens [0, >= end), shared by the blocks of one insert: events rebuild from it
        self.slots = slots
        self.ref_cnt = 0
        self.reachable = True  # every ancestor resident

    @property
    def token_ids(self) -> TokenArray:
        return self.prefix[self.start : self.start + len(self.slots)]

    def __repr__(self) -> str:
        return f"Block({self.hash.hex()[:8]}, start={self.start}, ref_cnt={self.ref_cnt})"


class BlockHashCache(BasePrefixCache[Block]):
    """Chained-hash blocks with an LRU free queue. ``page_size == block_size``."""

    def __init__(
        self,
        allocator: TokenAllocator,
        block_size: int = 16,
        clock: Clock | None = None,
        listeners: Sequence[CacheListener] = (),
        tail_first_release: bool = True,
    ) -> None:
        super().__init__(allocator, block_size, listeners)
        self.block_size = block_size
        self.clock: Clock = clock or time.monotonic  # unused: the queue order is the only recency
        self.tail_first_release = tail_first_release
        self.root = Block(ROOT_HASH, ROOT_HASH, None, 0, np.empty(0, dtype=np.int64), EMPTY_INDICES)
        self.root.ref_cnt = 1  # never in the queue; ends every lock walk
        self._clear()

    def _clear(self) -> None:
        self._blocks: dict[bytes, Block] = {}
        self._children: dict[bytes, set[bytes]] = {}  # parent hash -> resident child hashes
        self._free_queue: OrderedDict[bytes, Block] = OrderedDict()  # ref_cnt == 0, LRU first
        self._evictable_size = self._protected_size = self._unreachable_size = 0

    def unreachable_size(self) -> int:
        """Tokens in resident blocks with a missing ancestor: held, never a hit."""
        return self._unreachable_size

    # ---- match / insert ---------------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult[Block]:
        """Slots of the leading run of resident blocks of ``key`` (whole blocks). Pure.

        Hashes lazily and stops at the first missing block. Changes nothing, not
        even recency. Lock ``last_node`` before using the indices: until then
        eviction may free them. ``last_node`` is ``self.root`` when nothing matched.
        """
        last, found = self.root, []
        for block_hash in page_hashes(key.token_ids, key.extra_key, self.block_size):
            block = self._blocks.get(block_hash)
            if block is None:
                break
            found.append(block.slots)
            last = block
        if not found:
            return MatchResult(EMPTY_INDICES, self.root)
        return MatchResult(found[0] if len(found) == 1 else np.concatenate(found), last)

    def insert(self, key: RadixKey, indices: IndexArray, priority: int = 0, count_hit: bool = True) -> int:
        """Cache ``key`` -> ``indices``; return the length of the leading run already cached.

        Mutates. Takes ownership of ``indices[returned:]`` (copied); a block past
        the run that is resident (unreachable until now) takes the new slots and
        its old slots are freed here. Every unlocked block of ``key`` then
        (re-)enters the free queue's end, tail first. ``priority`` and
        ``count_hit`` are ignored: vLLM has one policy, the queue order.
        """
        size, tokens, extra_key = self.block_size, key.token_ids, key.extra_key
        if len(key) != len(indices) or len(key) % size:
            raise ValueError(f"insert needs block-aligned key and indices of one length: {len(key)}, {len(indices)}")
        path: list[Block] = []
        parent, cached_len = ROOT_HASH, -1  # cached_len: set at the first missing block
        prefix, owned, run_start = tokens, indices, -1  # run_start: the run of new blocks (one event)
        for start, block_hash in zip(range(0, len(tokens), size), page_hashes(tokens, extra_key, size)):
            block = self._blocks.get(block_hash)
            if block is None:  # from the first miss on, the cache takes the slots
                if cached_len < 0:  # one copy each, shared by every block stored below
                    cached_len, prefix, owned = start, tokens.copy(), indices[start:].copy()
                slots = owned[start - cached_len : start - cached_len + size]
                block = self._store(block_hash, parent, extra_key, start, prefix, slots)
                run_start = start if run_start < 0 else run_start
            elif cached_len >= 0:  # resident past a miss: unreachable until the store before it
                assert block.ref_cnt == 0 and block.reachable, f"{block!r} past a miss"
                self.allocator.free(block.slots)
                block.slots = owned[start - cached_len : start - cached_len + size]
                run_start = self._record_store(extra_key, run_start, prefix[:start], indices[:start])
            path.append(block)
            parent = block_hash
        self._record_store(extra_key, run_start, prefix, indices)
        for block in reversed(path):  # tail first: descendants sit before ancestors
            if block.ref_cnt == 0:
                self._free_queue[block.hash] = block
                self._free_queue.move_to_end(block.hash)
        return len(tokens) if cached_len < 0 else cached_len

    # ---- eviction ---------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Pop blocks from the free queue's front until ``num_tokens`` slots are freed.

        Mutates; frees the slots to the allocator. Locked blocks are never in the
        queue. Returns slots freed (whole blocks; fewer only when the queue ran out).
        """
        freed, run_tail, run_head = 0, None, None  # a chain evicted tail to head: one remove event
        slots: list[IndexArray] = []
        run: list[IndexArray] = []  # the chain's slots, tail first
        while freed < num_tokens and self._free_queue:
            _, block = self._free_queue.popitem(last=False)
            slots.append(block.slots)
            freed += len(block.slots)
            self._remove(block)
            if self._listeners:
                if run_head is None or run_head.parent_hash != block.hash:
                    self._record_remove(run_tail, run_head, run)
                    run_tail, run = block, []
                run_head = block
                run.append(block.slots)
        self._record_remove(run_tail, run_head, run)
        if slots:  # one allocator call for the whole batch
            self.allocator.free(np.concatenate(slots))
        self.evicted_tokens += freed
        return freed

    # ---- locking ----------------------------------------------------------------------------

    def inc_lock_ref(self, node: Block | None) -> int:
        """Lock ``node`` and every ancestor; return the (non-positive) evictable-size delta.

        ``node`` must be a resident, reachable block (a ``match_prefix`` result).
        A block whose count goes 0 -> 1 leaves the free queue. Root/None: no-op.
        """
        if node is None or node is self.root:
            return 0
        if self._blocks.get(node.hash) is not node or not node.reachable:
            raise RuntimeError(f"inc_lock_ref on {node!r}: not a resident, reachable block")
        delta, block = 0, node
        while block is not self.root:
            if block.ref_cnt == 0:
                del self._free_queue[block.hash]
                delta -= len(block.slots)
            block.ref_cnt += 1
            block = self._parent(block)
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    def dec_lock_ref(self, node: Block | None) -> int:
        """Undo one ``inc_lock_ref(node)``; return the (non-negative) evictable-size delta.

        Blocks reaching 0 join the free queue's end: tail first, or head first
        with ``tail_first_release=False``. Raises RuntimeError if unbalanced.
        """
        if node is None or node is self.root:
            return 0
        if node.ref_cnt <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}: unbalanced lock")
        released, block = [], node
        while block is not self.root:  # a parent's count >= its child's: never goes negative
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
            block = self._parent(block)
        if not self.tail_first_release:
            released.reverse()
        for block in released:
            self._free_queue[block.hash] = block
        delta = sum(len(block.slots) for block in released)
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    # ---- walking ----------------------------------------------------------------------------

    def blocks(self) -> list[Block]:
        """Every resident block, in storage order."""
        return list(self._blocks.values())

    def free_queue(self) -> list[Block]:
        """The unlocked blocks, next to be evicted first."""
        return list(self._free_queue.values())

    def cached_slots(self) -> IndexArray:
        slots = [block.slots for block in self._blocks.values()]
        return np.concatenate(slots) if slots else EMPTY_INDICES

    def check_invariants(self) -> None:
        """Recompute every counter and link by brute force (O(blocks)); AssertionError on a mismatch."""
        from radixserve.cache.baselines.block_check import check_block_invariants

        check_block_invariants(self)

    def pretty_print(self) -> str:
        """One line per block, reachable ones first, by position; printed and returned."""
        from radixserve.cache.baselines.block_check import format_blocks

        text = format_blocks(self)
        print(text)
        return text

    # ---- internals --------------------------------------------------------------------------

    def _parent(self, block: Block) -> Block:
        return self.root if block.parent_hash == ROOT_HASH else self._blocks[block.parent_hash]

    def _store(
        self,
        block_hash: bytes,
        parent: bytes,
        extra_key: str | None,
        start: int,
        prefix: TokenArray,
        slots: IndexArray,
    ) -> Block:
        """Add a block whose ancestors are all resident; its stranded descendants become reachable."""
        block = Block(block_hash, parent, extra_key, start, prefix, slots)
        self._blocks[block_hash] = block
        self._children.setdefault(parent, set()).add(block_hash)
        self._evictable_size += len(slots)
        self._mark_descendants(block_hash, reachable=True)
        return block

    def _remove(self, block: Block) -> None:
        """Drop an evicted block from the map; its resident descendants become unreachable."""
        del self._blocks[block.hash]
        siblings = self._children[block.parent_hash]
        siblings.discard(block.hash)
        if not siblings:
            del self._children[block.parent_hash]
        self._evictable_size -= len(block.slots)
        if block.reachable:
            self._mark_descendants(block.hash, reachable=False)
        else:
            self._unreachable_size -= len(block.slots)

    def _mark_descendants(self, block_hash: bytes, reachable: bool) -> None:
        """Flip the reachability of the resident subtree below ``block_hash`` (cost: that subtree)."""
        stack = list(self._children.get(block_hash, ()))
        while stack:
            block = self._blocks[stack.pop()]
            assert block.reachable != reachable, f"{block!r} already {'' if reachable else 'un'}reachable"
            block.reachable = reachable
            self._unreachable_size += -len(block.slots) if reachable else len(block.slots)
            stack.extend(self._children.get(block.hash, ()))

    def _record_store(self, extra_key: str | None, run_start: int, prefix: TokenArray, slots: IndexArray) -> int:
        """Tell the listeners of the run of new blocks ``prefix[run_start:]`` (``slots``: the prefix's); return -1."""
        if self._listeners and 0 <= run_start < len(prefix):
            self._inserted(RadixKey(prefix, extra_key), slots, run_start)
        return -1

    def _record_remove(self, tail: Block | None, head: Block | None, run: list[IndexArray]) -> None:
        """Tell the listeners of the evicted chain from ``head`` down to ``tail`` (``run``: its slots, tail first)."""
        if tail is not None and head is not None:
            end = tail.start + len(tail.slots)
            self._evicting(RadixKey(tail.prefix[:end], tail.extra_key), np.concatenate(run[::-1]), head.start)
