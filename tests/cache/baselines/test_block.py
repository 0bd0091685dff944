"""BlockHashCache: named behaviours, then a state machine against a brute-force reference.

The reference knows nothing of hashes: a dict from (namespace, block-aligned
prefix) to that block's slots, lock count and the tick it last entered the
free queue. Lookup is "longest run of resident blocks from the start"; the
queue is "ref-0 blocks sorted by tick".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import radixserve.cache.baselines.block as block_module
from radixserve.cache import BlockHashCache, CacheReq, KVEvent, KVEventLog, RadixKey, create_prefix_cache
from radixserve.cache.baselines.block import Block
from radixserve.cache.core.key import TokenArray
from radixserve.cache.core.radix_check import check_slot_conservation
from radixserve.memory import TokenAllocator
from radixserve.memory.allocator import IndexArray
from tests.cache.helpers import serve, start, tokens
from tests.machine_settings import machine_settings

BlockKey = tuple[str | None, tuple[int, ...]]


def make_cache(
    size: int = 256, block_size: int = 4, enable_kv_events: bool = False, tail_first_release: bool = True
) -> BlockHashCache:
    events = [KVEventLog(block_size)] if enable_kv_events else []
    return BlockHashCache(TokenAllocator(size), block_size, None, events, tail_first_release)


def block_key(block: Block) -> BlockKey:
    return (block.extra_key, tuple(block.prefix[: block.start + len(block.slots)].tolist()))


def matched(cache: BlockHashCache, token_ids: list[int], ns: str | None = None) -> int:
    return len(cache.match_prefix(RadixKey(token_ids, ns)).indices)


def strand_middle_block(cache: BlockHashCache, chain: list[int]) -> None:
    """With head-first release, evict chain's 2nd block while its 1st, 3rd and 4th stay."""
    serve(cache, chain)
    serve(cache, chain)  # locked whole, released head first: queue = b0 b1 b2 b3
    holder = start(cache, chain[:4])  # locks b0 only: queue = b1 b2 b3
    assert cache.evict(1) == 4
    cache.cache_finished_req(holder)


# ---- named behaviours --------------------------------------------------------------------------


def test_lookup_stops_at_first_missing_block() -> None:
    cache = make_cache(tail_first_release=False)
    chain = tokens(16)
    strand_middle_block(cache, chain)
    cache.check_invariants()
    assert matched(cache, chain) == 4  # b2, b3 are resident but behind the missing b1
    assert cache.total_size() == 12 and cache.unreachable_size() == 8
    assert "UNREACHABLE" in cache.pretty_print()
    assert cache.evict(1000) == 12 and cache.unreachable_size() == 0
    cache.check_invariants()


def test_reinserting_missing_ancestor_makes_descendants_reachable() -> None:
    cache = make_cache(tail_first_release=False)
    chain = tokens(16)
    strand_middle_block(cache, chain)
    stranded = {int(s) for b in cache.blocks() if not b.reachable for s in b.slots}
    fresh = cache.allocator.alloc(16)
    assert fresh is not None
    assert cache.insert(RadixKey(chain), fresh) == 4
    cache.allocator.free(fresh[:4])  # the caller frees only the already-cached run
    assert cache.unreachable_size() == 0 and cache.total_size() == 16
    assert cache.match_prefix(RadixKey(chain)).indices[4:].tolist() == fresh[4:].tolist()
    assert cache.allocator.is_free(np.array(sorted(stranded))).all(), "replaced slots were not freed"
    cache.check_invariants()
    check_slot_conservation(cache, [])


def test_insert_refreshes_a_path_cached_meanwhile_so_tail_first_never_strands() -> None:
    cache = make_cache()
    prompt, other = tokens(8), tokens(4)
    req = start(cache, prompt)  # nothing cached yet: all 8 slots private
    serve(cache, prompt[:4])  # another request caches the first block meanwhile
    serve(cache, other)
    cache.cache_finished_req(req)  # first block already cached: only the second is new
    assert cache.evict(1) == 4 and matched(cache, other) == 0, "the first block was not refreshed"
    assert matched(cache, prompt) == 8 and cache.unreachable_size() == 0
    cache.check_invariants()
    check_slot_conservation(cache, [])


def test_partial_last_block_not_cached() -> None:
    cache = make_cache(block_size=16)
    prompt = tokens(40)
    assert serve(cache, prompt) == 0
    assert cache.total_size() == 32 and matched(cache, prompt) == 32
    assert matched(cache, prompt[:31]) == 16
    assert serve(cache, prompt) == 32
    check_slot_conservation(cache, [])


def test_namespaces_never_share_a_block() -> None:
    cache = make_cache()
    prompt = tokens(8)
    serve(cache, prompt)
    assert matched(cache, prompt, "a") == 0
    assert serve(cache, prompt, "a") == 0 and serve(cache, prompt, "b") == 0
    assert cache.total_size() == 24
    assert [matched(cache, prompt, ns) for ns in (None, "a", "b")] == [8, 8, 8]
    cache.check_invariants()


def test_lru_evicts_released_longest_ago_and_tail_before_head() -> None:
    cache = make_cache()
    a, b, c = tokens(8), tokens(8), tokens(8)
    for prompt in (a, b, c, a):  # a is reused last: b is the oldest release
        serve(cache, prompt)
    assert cache.evict(1) == 4
    assert matched(cache, b) == 4, "the tail block goes before its head"
    assert cache.evict(1) == 4 and matched(cache, b) == 0
    assert matched(cache, c) == 8 and matched(cache, a) == 8
    cache.check_invariants()


def test_never_cached_slots_are_used_before_evicting() -> None:
    cache = make_cache(size=32)
    serve(cache, tokens(16))
    assert cache.alloc_slots(16) is not None and cache.total_size() == 16, "evicted while slots were free"
    assert cache.alloc_slots(4) is not None and cache.total_size() == 12


def test_match_is_pure_and_hashes_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache()
    a, b = tokens(8), tokens(8)
    serve(cache, a)
    serve(cache, b)
    before = [block_key(x) for x in cache.free_queue()]
    calls: list[int] = []
    real_page_hashes = block_module.page_hashes

    def counting(*args: Any) -> Iterator[bytes]:
        for page_hash in real_page_hashes(*args):
            calls.append(1)
            yield page_hash

    monkeypatch.setattr(block_module, "page_hashes", counting)
    assert matched(cache, tokens(400)) == 0 and len(calls) == 1, "hashing went past the first miss"
    monkeypatch.undo()
    assert matched(cache, a) == 8
    assert [block_key(x) for x in cache.free_queue()] == before, "match changed recency"


def test_locked_blocks_are_never_evicted() -> None:
    cache = make_cache()
    held, other = tokens(12), tokens(8)
    serve(cache, held)
    req = start(cache, held + tokens(3))
    serve(cache, other)
    assert cache.protected_size() == 12 and cache.evictable_size() == 8
    assert cache.evict(1000) == 8
    assert matched(cache, held) == 12 and cache.total_size() == 12
    cache.cache_finished_req(req)
    assert cache.evictable_size() == 12 and cache.protected_size() == 0
    check_slot_conservation(cache, [])


def test_lock_deltas_and_unbalanced_dec_raises() -> None:
    cache = make_cache()
    prompt = tokens(12)
    serve(cache, prompt)
    node = cache.match_prefix(RadixKey(prompt)).last_node
    assert cache.inc_lock_ref(node) == -12 and cache.inc_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 12
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    root = cache.match_prefix(RadixKey(tokens(4))).last_node
    assert root is cache.root
    assert cache.inc_lock_ref(root) == cache.dec_lock_ref(root) == cache.inc_lock_ref(None) == 0
    cache.check_invariants()


def test_reset_with_a_lock_raises_then_frees_everything() -> None:
    cache = make_cache()
    prompt = tokens(8)
    serve(cache, prompt)
    req = start(cache, prompt + tokens(2))
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.cache_finished_req(req)
    cache.reset()
    assert cache.total_size() == 0 and cache.allocator.free_size() == cache.allocator.size
    cache.check_invariants()


def test_insert_rejects_unaligned_or_mismatched() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert(RadixKey(tokens(6)), np.arange(1, 7))
    with pytest.raises(ValueError):
        cache.insert(RadixKey(tokens(8)), np.arange(1, 5))
    with pytest.raises(ValueError):
        BlockHashCache(TokenAllocator(64, 4), block_size=6)


def test_factory_builds_block_cache_with_vllm_default_block() -> None:
    cache = create_prefix_cache("block", TokenAllocator(64))
    assert isinstance(cache, BlockHashCache) and cache.page_size == 16


def test_events_replay_to_the_resident_blocks() -> None:
    cache = make_cache(enable_kv_events=True, tail_first_release=False)
    chain = tokens(16)
    strand_middle_block(cache, chain)
    serve(cache, chain)
    cache.evict(8)
    replayed = apply_events(set(), cache.events.drain() if cache.events else [], 4)
    assert replayed == {block_key(b) for b in cache.blocks()}


def apply_events(resident: set[BlockKey], events: list[KVEvent], block_size: int) -> set[BlockKey]:
    for event in events:
        assert len(event.block_hashes) == (event.end - event.start) // block_size
        for end in range(event.start + block_size, event.end + 1, block_size):
            key = (event.extra_key, tuple(event.key.token_ids[:end].tolist()))
            if event.kind == "store":
                assert key not in resident, f"stored twice: {key}"
                resident.add(key)
            else:
                resident.remove(key)
    return resident


# ---- the reference model -----------------------------------------------------------------------


@dataclass
class RefBlock:
    slots: list[int]
    ref_cnt: int = 0
    tick: int = 0  # when it last entered the free queue


class Reference:
    """What the cache should hold, by brute force over (namespace, prefix) keys."""

    def __init__(self, block_size: int, tail_first: bool) -> None:
        self.block_size, self.tail_first = block_size, tail_first
        self.blocks: dict[BlockKey, RefBlock] = {}
        self.ticks = itertools.count()

    def path(self, ns: str | None, token_ids: TokenArray) -> list[BlockKey]:
        ends = range(self.block_size, len(token_ids) + 1, self.block_size)
        return [(ns, tuple(token_ids[:end].tolist())) for end in ends]

    def match(self, ns: str | None, token_ids: TokenArray) -> list[int]:
        slots: list[int] = []
        for key in self.path(ns, token_ids):
            if key not in self.blocks:
                break
            slots += self.blocks[key].slots
        return slots

    def insert(self, ns: str | None, token_ids: TokenArray, indices: IndexArray) -> int:
        path, size = self.path(ns, token_ids), self.block_size
        run = len(self.match(ns, token_ids)) // size
        for i, key in enumerate(path[run:], run):
            slots = indices[i * size : (i + 1) * size].tolist()
            if key in self.blocks:
                assert self.blocks[key].ref_cnt == 0
                self.blocks[key].slots = slots
            else:
                self.blocks[key] = RefBlock(slots)
        for key in reversed(path):
            if self.blocks[key].ref_cnt == 0:
                self.blocks[key].tick = next(self.ticks)
        return run * size

    def lock(self, ns: str | None, token_ids: TokenArray, step: int) -> None:
        released = []
        for key in self.path(ns, token_ids):
            self.blocks[key].ref_cnt += step
            assert self.blocks[key].ref_cnt >= 0
            if step < 0 and self.blocks[key].ref_cnt == 0:
                released.append(key)
        for key in reversed(released) if self.tail_first else released:
            self.blocks[key].tick = next(self.ticks)

    def queue(self) -> list[BlockKey]:
        free = [key for key, block in self.blocks.items() if block.ref_cnt == 0]
        return sorted(free, key=lambda key: self.blocks[key].tick)

    def evict(self, num_tokens: int) -> list[BlockKey]:
        victims = self.queue()[: max(0, -(-num_tokens // self.block_size))]
        for key in victims:
            del self.blocks[key]
        return victims

    def unreachable_size(self) -> int:
        def reachable(key: BlockKey) -> bool:
            ns, prefix = key
            return all(
                (ns, prefix[:end]) in self.blocks for end in range(self.block_size, len(prefix), self.block_size)
            )

        return sum(self.block_size for key in self.blocks if not reachable(key))


class CheckedBlockCache(BlockHashCache):
    """Checks every insert and evict against the reference as it happens (also inside alloc_slots)."""

    ref: Reference

    def insert(self, key: RadixKey, indices: IndexArray, priority: int = 0, count_hit: bool = True) -> int:
        expected = self.ref.insert(key.extra_key, key.token_ids, indices)
        assert super().insert(key, indices, priority, count_hit) == expected, "insert's cached length"
        return expected

    def evict(self, num_tokens: int) -> int:
        before = {block_key(b) for b in self.blocks()}
        victims = self.ref.evict(num_tokens)  # a prefix of the queue: equal sets means equal order
        freed = super().evict(num_tokens)
        assert before - {block_key(b) for b in self.blocks()} == set(victims), "evicted out of LRU order"
        assert freed == len(victims) * self.block_size
        return freed


def key_strategy(block_size: int) -> st.SearchStrategy[tuple[str | None, list[int]]]:
    chunks = [[(c + i) % 3 + 1 for i in range(block_size)] for c in range(3)] + [[7] * block_size]
    body = st.lists(st.sampled_from(chunks), max_size=4).map(lambda cs: [t for c in cs for t in c])
    tail = st.lists(st.integers(1, 3), max_size=block_size + 1)
    namespace = st.sampled_from([None, "a", "b"])
    return st.tuples(namespace, st.tuples(body, tail).map(lambda bt: bt[0] + bt[1]))


class BlockMachine(RuleBasedStateMachine):
    block_size, alloc_page, tail_first = 2, 1, True

    def __init__(self) -> None:
        super().__init__()
        allocator = TokenAllocator(12 * self.block_size, self.alloc_page)
        self.cache = CheckedBlockCache(allocator, self.block_size, None, [KVEventLog(self.block_size)], self.tail_first)
        self.cache.ref = self.ref = Reference(self.block_size, self.tail_first)
        self.live: list[CacheReq] = []
        self.replayed: set[BlockKey] = set()
        self.history: list[tuple[str | None, list[int]]] = []

    def locked(self, req: CacheReq) -> TokenArray:
        return req.token_ids[: req.cache_protected_len]

    def draw_key(self, data: st.DataObject) -> tuple[str | None, list[int]]:
        """A fresh key, or often a past or stranded one cut short and regrown (revisits evicted paths)."""
        ns, token_ids = data.draw(key_strategy(self.block_size))
        stranded = [(ns, list(prefix)) for ns, prefix in map(block_key, self.stranded())]
        if len(stranded) > 0 and data.draw(st.booleans()):
            return data.draw(st.sampled_from(stranded))
        if len(self.history) > 0 and data.draw(st.booleans()):
            ns, old = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.sampled_from([len(old), len(old), data.draw(st.integers(0, len(old)))]))
            token_ids = old[:cut] + token_ids[: self.block_size]
        self.history.append((ns, token_ids))
        return ns, token_ids

    def stranded(self) -> list[Block]:
        return [block for block in self.cache.blocks() if not block.reachable]

    @precondition(lambda self: len(self.live) < 3)
    @rule(data=st.data())
    def open_request(self, data: st.DataObject) -> None:
        ns, token_ids = self.draw_key(data)
        arr = np.asarray(token_ids, dtype=np.int64)
        req = self.cache.open_request(RadixKey(arr, ns))
        assert req.kv_indices.tolist() == self.ref.match(ns, arr), "match differs from brute force"
        self.ref.lock(ns, self.locked(req), +1)
        if self.cache.extend_request(req, arr[len(req.kv_indices) :]):
            self.live.append(req)
        else:  # the pool can't hold it
            self.ref.lock(ns, self.locked(req), -1)
            self.cache.cache_finished_req(req, is_insert=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), is_insert=st.booleans())
    def finish_request(self, data: st.DataObject, is_insert: bool) -> None:
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        old = self.locked(req)
        self.cache.cache_finished_req(req, is_insert=is_insert)
        self.ref.lock(req.extra_key, old, -1)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), more=st.lists(st.integers(1, 3), max_size=5))
    def chunk_request(self, data: st.DataObject, more: list[int]) -> None:
        req = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        old = self.locked(req)
        self.cache.cache_unfinished_req(req)
        self.ref.lock(req.extra_key, self.locked(req), +1)
        self.ref.lock(req.extra_key, old, -1)
        self.cache.extend_request(req, np.asarray(more, dtype=np.int64))

    @rule(num_blocks=st.integers(0, 3), extra=st.integers(0, 1))
    def evict(self, num_blocks: int, extra: int) -> None:
        self.cache.evict(num_blocks * self.block_size - extra)  # whole blocks, or a token short of them

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ns, token_ids = self.draw_key(data)
        indices, node = self.cache.match_prefix(RadixKey(token_ids, ns))
        assert indices.tolist() == self.ref.match(ns, np.asarray(token_ids, dtype=np.int64))
        assert (node is self.cache.root) == (len(indices) == 0)

    @invariant()
    def everything_holds(self) -> None:
        self.cache.check_invariants()
        check_slot_conservation(self.cache, self.live)
        actual = {block_key(b): (b.slots.tolist(), b.ref_cnt) for b in self.cache.blocks()}
        assert actual == {key: (b.slots, b.ref_cnt) for key, b in self.ref.blocks.items()}
        assert [block_key(b) for b in self.cache.free_queue()] == self.ref.queue(), "free queue order"
        assert self.cache.unreachable_size() == self.ref.unreachable_size()
        locked = sum(self.block_size for b in self.ref.blocks.values() if b.ref_cnt)
        assert self.cache.protected_size() == locked
        assert self.cache.evictable_size() == len(self.ref.blocks) * self.block_size - locked
        events = self.cache.events.drain() if self.cache.events else []
        assert apply_events(self.replayed, events, self.block_size) == set(actual), "events disagree"

    def teardown(self) -> None:
        for req in self.live:
            self.cache.cache_finished_req(req)
        self.cache.check_invariants()
        check_slot_conservation(self.cache, [])


@pytest.mark.parametrize("tail_first", [True, False])
@pytest.mark.parametrize(("block_size", "alloc_page"), [(2, 1), (4, 2)])
def test_block_cache_matches_reference(block_size: int, alloc_page: int, tail_first: bool) -> None:
    attrs = {"block_size": block_size, "alloc_page": alloc_page, "tail_first": tail_first}
    machine = type("Machine", (BlockMachine,), attrs)
    run_state_machine_as_test(machine, settings=machine_settings(60, 50))
