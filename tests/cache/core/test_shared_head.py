"""Shared heads: an allowlisted public prefix is shared across namespaces, everything after it is not.

A key ``RadixKey(tokens, extra_key, shared_len)`` puts its first ``shared_len``
tokens in the shared namespace (None) and the rest in ``extra_key``. Checked
against a brute-force reference where every cached position is a
(namespace, token) pair: a match is the longest run of equal pairs.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import KVEventLog, RadixCache, RadixKey
from radixserve.cache.core.radix_check import check_slot_conservation
from radixserve.memory import TokenAllocator

PUBLIC = [1, 2, 3, 4, 5, 6, 7, 8]


def pairs(tokens: list[int], ns: str | None, shared_len: int) -> list[tuple[str | None, int]]:
    return [(None if i < shared_len or ns is None else ns, t) for i, t in enumerate(tokens)]


def reference_match(cached: list[list[tuple[str | None, int]]], key: list[tuple[str | None, int]], page: int) -> int:
    best = 0
    for path in cached:
        n = 0
        while n < min(len(path), len(key)) and path[n] == key[n]:
            n += 1
        best = max(best, n)
    return best - best % page


def serve(cache: RadixCache, tokens: list[int], ns: str | None, shared_len: int) -> int:
    req = cache.open_request(RadixKey(tokens, ns, shared_len))
    hit = req.cache_protected_len
    assert cache.extend_request(req, np.asarray(tokens[hit:]))
    cache.cache_finished_req(req)
    return hit


def test_two_tenants_share_the_public_head_and_nothing_else() -> None:
    cache = RadixCache(TokenAllocator(1024))
    question = [50, 51, 52]
    assert serve(cache, PUBLIC + question, "tenant-a", len(PUBLIC)) == 0
    assert serve(cache, PUBLIC + question, "tenant-b", len(PUBLIC)) == len(PUBLIC)  # the head, not the question
    assert serve(cache, PUBLIC + question, "tenant-a", len(PUBLIC)) == len(PUBLIC) + 3  # a's own private part
    assert serve(cache, PUBLIC + question, "tenant-c", 0) == 0  # no allowlist: fully private
    assert serve(cache, PUBLIC[:5] + [99], "tenant-d", 5) == 5  # a shorter head: split inside the public edge
    cache.check_invariants()
    check_slot_conservation(cache, [])


def test_a_head_never_matches_a_private_continuation() -> None:
    cache = RadixCache(TokenAllocator(1024))
    serve(cache, PUBLIC + [60, 61], None, 0)  # unsalted: all in the shared namespace
    # a tenant whose head is only the first 4 tokens may not read [5..8] as shared: they are its private part
    assert serve(cache, PUBLIC + [60, 61], "tenant-a", 4) == 4
    cache.check_invariants()


@st.composite
def request_streams(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], str | None, int]]]:
    page = draw(st.sampled_from([1, 2, 4]))
    requests = []
    for _ in range(draw(st.integers(1, 30))):
        head = draw(st.integers(0, len(PUBLIC)))
        tokens = PUBLIC[:head] + draw(st.lists(st.integers(1, 12), min_size=1, max_size=10))
        ns = draw(st.sampled_from([None, "a", "b"]))
        shared = draw(st.integers(0, len(tokens)))
        requests.append((tokens, ns, shared))
    return page, requests


@settings(max_examples=300)
@given(request_streams())
def test_matches_equal_the_brute_force_reference(case: tuple[int, list[tuple[list[int], str | None, int]]]) -> None:
    page, requests = case
    cache = RadixCache(TokenAllocator(4096, page), page)
    cached: list[list[tuple[str | None, int]]] = []
    for tokens, ns, shared in requests:
        aligned_shared = shared - shared % page
        key_pairs = pairs(tokens, ns, aligned_shared)
        expected = reference_match(cached, key_pairs[: len(tokens) - len(tokens) % page], page)
        assert serve(cache, tokens, ns, shared) == expected, (tokens, ns, shared)
        cached.append(key_pairs[: len(tokens) - len(tokens) % page])
        cache.check_invariants()
        check_slot_conservation(cache, [])
    for tokens, ns, shared in requests:  # every request now hits its whole (page-rounded) self
        assert len(cache.match_prefix(RadixKey(tokens, ns, shared)).indices) == len(tokens) - len(tokens) % page


def test_events_hash_the_head_in_the_shared_namespace() -> None:
    cache = RadixCache(TokenAllocator(1024), listeners=[KVEventLog(1)])
    serve(cache, PUBLIC + [40, 41], "tenant-a", len(PUBLIC))
    serve(cache, PUBLIC + [40, 41], "tenant-b", len(PUBLIC))
    a, b = cache.events.drain()  # type: ignore[union-attr]
    unsalted = RadixCache(TokenAllocator(1024), listeners=[KVEventLog(1)])
    serve(unsalted, PUBLIC, None, 0)
    [public] = unsalted.events.drain()  # type: ignore[union-attr]
    assert a.block_hashes[: len(PUBLIC)] == public.block_hashes  # the head hashes as shared
    assert b.start == len(PUBLIC) and b.block_hashes != a.block_hashes[len(PUBLIC) :]  # private parts differ


def test_a_request_key_keeps_its_shared_head_while_it_grows_chunk_by_chunk() -> None:
    cache = RadixCache(TokenAllocator(1024), listeners=[KVEventLog(1)])
    req = cache.open_request(RadixKey(PUBLIC + [40, 41], "tenant-a", len(PUBLIC)))  # cold: nothing matched
    assert len(req.key) == 0 and req.key.shared_len == 0
    assert cache.extend_request(req, PUBLIC[:3])  # the first chunk stops inside the head
    cache.cache_unfinished_req(req)
    assert req.key.shared_len == 3
    assert cache.extend_request(req, PUBLIC[3:] + [40, 41])
    assert req.key.shared_len == len(PUBLIC) and req.key.namespace_at(len(PUBLIC)) == "tenant-a"
    cache.cache_finished_req(req)
    cache.check_invariants()
    # another tenant finds the head, which the chunked request cached as shared
    assert serve(cache, PUBLIC + [40, 41], "tenant-b", len(PUBLIC)) == len(PUBLIC)


def test_a_removed_private_leaf_is_announced_under_the_head_above_it() -> None:
    cache = RadixCache(TokenAllocator(1024), listeners=[KVEventLog(1)])
    serve(cache, PUBLIC + [40, 41], "tenant-a", len(PUBLIC))
    [stored] = cache.events.drain()  # type: ignore[union-attr]
    [leaf] = [node for node in cache.nodes() if node.key.extra_key == "tenant-a"]
    path = cache.path_key(leaf)
    assert (path.extra_key, path.shared_len, path.token_ids.tolist()) == ("tenant-a", len(PUBLIC), PUBLIC + [40, 41])
    cache.evict(2)  # the private leaf only
    [removed] = cache.events.drain()  # type: ignore[union-attr]
    assert removed.kind == "remove" and removed.start == len(PUBLIC)
    assert removed.block_hashes == stored.block_hashes[len(PUBLIC) :]  # the same pages, hashed the same way


def test_join_of_one_namespace_edges() -> None:
    head, tail = RadixKey(PUBLIC), RadixKey([40, 41], "t")
    assert RadixKey.join([]).token_ids.tolist() == []
    assert RadixKey.join([head]).shared_len == 0  # all shared: no split to record
    joined = RadixKey.join([head, tail])
    assert (joined.extra_key, joined.shared_len, joined.head_len) == ("t", len(PUBLIC), len(PUBLIC))
    assert list(joined.page_hashes(2)) == list(RadixKey(PUBLIC + [40, 41], "t", len(PUBLIC)).page_hashes(2))
