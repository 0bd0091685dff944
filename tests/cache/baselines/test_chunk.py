import pytest

from radixserve.cache import ChunkCache, RadixKey, create_prefix_cache
from radixserve.cache.core.radix_check import check_slot_conservation
from radixserve.memory import TokenAllocator
from tests.cache.helpers import serve, start


def test_chunk_cache_never_matches_and_frees_everything() -> None:
    cache = create_prefix_cache("none", TokenAllocator(32))
    assert isinstance(cache, ChunkCache)
    assert serve(cache, [1, 2, 3]) == 0
    assert serve(cache, [1, 2, 3]) == 0
    assert len(cache.match_prefix(RadixKey([1, 2, 3])).indices) == 0
    assert cache.total_size() == 0 and cache.allocator.free_size() == 32


def test_chunk_cache_running_request_keeps_its_slots() -> None:
    cache = create_prefix_cache("none", TokenAllocator(32, 4), page_size=4)
    req = start(cache, list(range(1, 11)))
    cache.cache_unfinished_req(req)
    check_slot_conservation(cache, [req])
    assert cache.allocator.free_size() == 32 - 12
    cache.cache_finished_req(req)
    assert cache.allocator.free_size() == 32


def test_unknown_cache_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown prefix cache"):
        create_prefix_cache("lru-dict", TokenAllocator(8))
