"""Listeners attached when a cache is built hear every insert, eviction and reset, with the slots involved."""

from __future__ import annotations

import pytest

from radixserve.cache import BlockHashCache, KVEventLog, RadixCache, RadixKey, create_prefix_cache
from radixserve.memory import IndexArray, TokenAllocator
from tests.cache.helpers import serve


class Recorder:
    def __init__(self) -> None:
        self.heard: list[tuple[str, list[int], list[int], int]] = []

    def on_insert(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        self.heard.append(("insert", key.token_ids.tolist(), slots.tolist(), start))

    def on_evict(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        self.heard.append(("evict", key.token_ids.tolist(), slots.tolist(), start))

    def on_clear(self) -> None:
        self.heard.append(("clear", [], [], 0))


def test_the_radix_tree_tells_its_listeners_the_whole_path_and_its_slots() -> None:
    recorder = Recorder()
    cache = RadixCache(TokenAllocator(64), listeners=[recorder])
    serve(cache, [1, 2, 3])
    serve(cache, [1, 2, 4])  # splits: listeners hear only the new leaf [4], under the path [1, 2, 4]
    slots = {tuple(path): cache.match_prefix(RadixKey(path)).indices.tolist() for path in ([1, 2, 3], [1, 2, 4])}
    assert recorder.heard == [("insert", [1, 2, 3], slots[1, 2, 3], 0), ("insert", [1, 2, 4], slots[1, 2, 4], 2)]
    recorder.heard.clear()
    assert cache.evict(1) == 1  # one leaf, still readable when heard
    [(kind, path, path_slots, start)] = recorder.heard
    assert (kind, start) == ("evict", 2) and path_slots == slots[tuple(path)]
    cache.reset()
    assert recorder.heard[-1][0] == "clear"


def test_the_block_cache_tells_its_listeners_each_run_and_its_slots() -> None:
    recorder = Recorder()
    cache = BlockHashCache(TokenAllocator(64), 2, listeners=[recorder])
    serve(cache, [1, 2, 3, 4])
    slots = cache.match_prefix(RadixKey([1, 2, 3, 4])).indices.tolist()
    assert recorder.heard == [("insert", [1, 2, 3, 4], slots, 0)]
    assert cache.evict(4) == 4  # the chain, tail first: one eviction of both blocks
    assert recorder.heard[1:] == [("evict", [1, 2, 3, 4], slots, 0)]


def test_an_event_log_must_page_like_its_cache() -> None:
    with pytest.raises(ValueError, match="page"):
        RadixCache(TokenAllocator(64, 2), 2, listeners=[KVEventLog(1)])
    assert create_prefix_cache("block", TokenAllocator(64), listeners=[KVEventLog(16)]).events is not None


def test_events_and_tiers_are_given_when_the_cache_is_built_not_assigned_later() -> None:
    cache = RadixCache(TokenAllocator(64))
    with pytest.raises(AttributeError):
        cache.tiers = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cache.events = KVEventLog(1)  # type: ignore[misc]
    with pytest.raises(ValueError, match="radix"):
        create_prefix_cache("block", TokenAllocator(64), tiers=object())  # type: ignore[arg-type]
