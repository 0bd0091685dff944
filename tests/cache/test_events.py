import numpy as np

from radixserve.cache import KVEventLog, RadixCache
from radixserve.cache.core.key import ROOT_HASH, chain_hash
from radixserve.memory import TokenAllocator
from tests.cache.helpers import serve


def test_events_are_off_by_default() -> None:
    assert RadixCache(TokenAllocator(16)).events is None


def test_store_split_and_remove_events_describe_content_not_nodes() -> None:
    cache = RadixCache(TokenAllocator(64, 2), page_size=2, listeners=[KVEventLog(2)])
    serve(cache, [1, 2, 3, 4], extra_key="t")
    serve(cache, [1, 2, 5, 6], extra_key="t")  # splits [1,2,3,4]: no event, content unchanged
    stored = cache.events.drain() if cache.events else []
    assert [(e.kind, e.start, e.end, e.token_ids.tolist()) for e in stored] == [
        ("store", 0, 4, [1, 2, 3, 4]),
        ("store", 2, 4, [5, 6]),
    ]
    cache.evict(100)
    removed = cache.events.drain() if cache.events else []
    assert sorted((e.kind, e.start, e.end) for e in removed) == [("remove", 0, 2), ("remove", 2, 4), ("remove", 2, 4)]
    assert all(e.extra_key == "t" for e in removed)


def test_block_hashes_are_the_chained_page_hashes() -> None:
    cache = RadixCache(TokenAllocator(64, 2), page_size=2, listeners=[KVEventLog(2)])
    serve(cache, [1, 2, 3, 4, 5])  # the partial page [5] is not cached
    (event,) = cache.events.drain() if cache.events else []
    first = chain_hash(ROOT_HASH, None, np.array([1, 2]))
    assert event.block_hashes == [first, chain_hash(first, None, np.array([3, 4]))]


def test_reset_records_a_clear_event() -> None:
    cache = RadixCache(TokenAllocator(64), listeners=[KVEventLog(1)])
    serve(cache, [1, 2, 3])
    cache.reset()
    kinds = [e.kind for e in cache.events.drain()] if cache.events else []
    assert kinds == ["store", "clear"]
