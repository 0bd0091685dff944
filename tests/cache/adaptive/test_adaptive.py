"""The adaptive eviction policy: what its ghosts teach it, and the order it ends up with."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import RadixCache, RadixKey, TreeNode
from radixserve.cache.adaptive.candidates import AdaptiveCandidates, hit_class
from radixserve.cache.adaptive.class_heaps import ClassHeaps
from radixserve.memory import TokenAllocator
from tests.cache.helpers import serve, start

Rank = Callable[[TreeNode], tuple[float, ...]]


def depth(n: TreeNode) -> int:
    """Tokens above ``n``, counted the slow way (the root's key is empty)."""
    total, cursor = 0, n.parent
    while cursor is not None:
        total += len(cursor.key)
        cursor = cursor.parent
    return total


def lru(n: TreeNode) -> tuple[float, ...]:
    return (-depth(n), n.last_access_time, n.id)


def lfu_by_class(n: TreeNode) -> tuple[float, ...]:
    return (-depth(n), min(n.hit_count, 2), n.last_access_time, n.id)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cache(size: int) -> tuple[RadixCache, Clock]:
    clock = Clock()
    return RadixCache(TokenAllocator(size), 1, "adaptive", clock), clock


def candidates(cache: RadixCache) -> AdaptiveCandidates[TreeNode]:
    assert isinstance(cache.candidates, AdaptiveCandidates)
    return cache.candidates


def brute_force_order(cache: RadixCache, rank: Rank) -> list[int]:
    """Node ids in the order repeatedly taking the best-ranked unlocked leaf would evict them."""
    children = {n.id: len(n.children) for n in cache.nodes()}
    leaves = [n for n in cache.nodes() if n.lock_ref == 0 and not n.children]
    order = []
    while leaves:
        victim = min(leaves, key=rank)
        leaves.remove(victim)
        order.append(victim.id)
        parent = victim.parent
        if parent is not None and parent is not cache.root:
            children[parent.id] -= 1
            if not children[parent.id] and parent.lock_ref == 0:
                leaves.append(parent)
    return order


def eviction_order(cache: RadixCache) -> list[int]:
    """Evict everything evictable, one leaf per call; the ids in the order they went."""
    order = []
    while cache.evictable_size():
        leaf = candidates(cache).pop()
        assert leaf is not None
        candidates(cache).add(leaf)  # put it back: evict() pops it again
        order.append(leaf.id)
        cache.evict(1)
    return order


def recency_trace(cache: RadixCache, clock: Clock, rng: np.random.Generator, length: int = 600) -> None:
    """Topics in a sliding window: each is asked about a few times, then never again (counts go stale).

    Every prompt is a shared system prefix + one of the 3 newest topics + a question asked once,
    so topics sit at one depth and compete by recency or frequency alone. Last, a new topic once.
    """
    system = [1, 2, 3, 4]
    for t in range(length + 1):
        clock.now = float(t)
        topic = t // 10 + int(rng.integers(3)) if t < length else 1_000_000
        serve(cache, system + [10_000 + 100 * topic + i for i in range(12)] + list(rng.integers(100_000, 900_000, 4)))


def frequency_trace(cache: RadixCache, clock: Clock, rng: np.random.Generator, length: int = 600) -> None:
    """RAG: a system prefix, Zipf-popular documents, each followed by a question never asked again."""
    docs = [[1, 2, 3, 4] + list(range(1000 * d + 1, 1000 * d + 41)) for d in range(1, 41)]
    popularity = 1.0 / np.arange(1, len(docs) + 1) ** 1.2
    for t in range(length):
        clock.now = float(t)
        doc = docs[int(rng.choice(len(docs), p=popularity / popularity.sum()))]
        serve(cache, doc + list(rng.integers(100_000, 900_000, 10)))


def test_orders_like_lru_after_a_recency_friendly_trace() -> None:
    cache, clock = make_cache(72)
    recency_trace(cache, clock, np.random.default_rng(0), length=4800)  # enough net votes take the shift to its floor
    assert candidates(cache).shift == 0.0
    expected = brute_force_order(cache, lru)
    assert expected != brute_force_order(cache, lfu_by_class), "the trace cannot tell LRU from LFU"
    assert eviction_order(cache) == expected


def test_orders_like_lfu_after_a_frequency_friendly_trace() -> None:
    cache, clock = make_cache(400)
    frequency_trace(cache, clock, np.random.default_rng(0))
    assert candidates(cache).shift > 0.0
    expected = brute_force_order(cache, lfu_by_class)
    assert expected != brute_force_order(cache, lru), "the trace cannot tell LRU from LFU"
    assert eviction_order(cache) == expected


def test_the_deepest_leaf_goes_first_whatever_its_recency() -> None:
    """Below a shared prefix, a question asked once goes before an older, shallower leaf (LRU evicts that first)."""
    cache, clock = make_cache(16)
    for t, prompt in enumerate(([1, 2, 3, 4], [1, 2, 5, 6, 7, 8, 9, 10], [1, 2, 5, 6, 7, 8, 11, 12])):
        clock.now = float(t)
        serve(cache, prompt)
    by_tokens = {tuple(n.key.token_ids.tolist()): n.id for n in cache.nodes()}
    deep_first = [
        by_tokens[(9, 10)],
        by_tokens[(11, 12)],
        by_tokens[(3, 4)],
        by_tokens[(5, 6, 7, 8)],
        by_tokens[(1, 2)],
    ]
    assert brute_force_order(cache, lru) == deep_first
    assert eviction_order(cache) == deep_first


def test_a_top_level_leaf_competes_by_recency_plus_the_top_shift() -> None:
    """An old one-off prompt (nothing above it) goes before newer deep leaves, unless top-level reuse was learned."""
    orders = []
    for top_shift in (0.0, 10.0):
        cache, clock = make_cache(16)
        for t, prompt in enumerate(([100, 101, 102, 103], [1, 2, 3, 4], [1, 2, 5, 6])):
            clock.now = float(t)
            serve(cache, prompt)
        candidates(cache).top_shift = top_shift
        names = {n.id: tuple(n.key.token_ids.tolist()) for n in cache.nodes()}
        orders.append([names[i] for i in eviction_order(cache)])
    one_off, shared = (100, 101, 102, 103), (1, 2)
    assert orders[0] == [one_off, (3, 4), (5, 6), shared]  # shift 0: recency across the groups
    assert orders[1] == [(3, 4), (5, 6), one_off, shared]  # learned: the deep leaves go first


def test_top_level_ghosts_grow_the_top_shift_and_deeper_ones_shrink_it() -> None:
    cache, clock = make_cache(8)
    for t, prompt in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):  # the third evicts [1..4]
        clock.now = float(t)
        serve(cache, prompt)
    clock.now = 5.0
    cache.match_prefix(RadixKey([1, 2, 3, 4]))  # a miss on a top-level ghost
    assert candidates(cache).top_shift > 0.0
    cache, clock = make_cache(8)
    for t, prompt in enumerate(([1, 2, 3, 4], [1, 2, 5, 6], [9, 10, 11])):  # the third evicts [3, 4], below [1, 2]
        clock.now = float(t)
        serve(cache, prompt)
    candidates(cache).top_shift = 5.0
    clock.now = 5.0
    cache.match_prefix(RadixKey([1, 2, 3, 4]))  # a miss on a ghost below the top level
    assert candidates(cache).top_shift < 5.0


def test_a_leaf_split_below_its_start_is_reranked_at_its_new_depth() -> None:
    """A partial match splits a leaf: its tail now starts below the top level and deeper, and is re-ranked."""
    cache, clock = make_cache(16)
    serve(cache, [20, 21])
    clock.now = 1.0
    serve(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    clock.now = 2.0
    cache.match_prefix(RadixKey([1, 2, 3, 4, 99]))  # splits [1..8] at 4; the tail [5..8] keeps access time 1
    cache.check_invariants()
    tail = next(n for n in cache.nodes() if n.key.token_ids[0] == 5)
    assert tail.depth == 4 and candidates(cache).slot_of(tail) >= candidates(cache).num_classes
    candidates(cache).top_shift = 100.0  # below the top level, the deepest first: the tail before [20, 21]
    assert eviction_order(cache)[0] == tail.id


def duel_setup() -> tuple[RadixCache, Clock]:
    """[1..4] reused once (class 1, older), [5..8] once (class 0); the shifted order evicts [5..8], LRU [1..4]."""
    cache, clock = make_cache(8)
    for t, prompt in enumerate(([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8])):
        clock.now = float(t)
        serve(cache, prompt)
    candidates(cache).shift = 100.0  # class 1 outlives class 0 by 100 clock units
    clock.now = 3.0
    serve(cache, [9, 10, 11, 12])  # evicts [5..8]: a duel against [1..4], which plain recency would have evicted
    assert cache.cached_len(RadixKey([1, 2, 3, 4])) == 4 and cache.cached_len(RadixKey([5, 6, 7, 8])) == 0
    assert candidates(cache).shift_horizons == 1.0
    return cache, clock


def test_the_evicted_leaf_asked_for_first_shrinks_the_shift() -> None:
    """[5..8] comes back before [1..4] is read: recency would have been right, the shift halves its way down."""
    cache, clock = duel_setup()
    clock.now = 4.0
    assert len(cache.match_prefix(RadixKey([5, 6, 7, 8])).indices) == 0
    assert candidates(cache).shift_horizons == pytest.approx(2**-0.25)


def test_the_kept_leaf_asked_for_first_grows_the_shift() -> None:
    """[1..4] is read before [5..8] comes back: keeping the reused leaf was right, the shift grows."""
    cache, clock = duel_setup()
    clock.now = 4.0
    assert len(cache.match_prefix(RadixKey([1, 2, 3, 4])).indices) == 4
    assert candidates(cache).shift_horizons == pytest.approx(2**0.25)
    clock.now = 5.0
    cache.match_prefix(RadixKey([5, 6, 7, 8]))  # the duel is settled: the victim's return votes no more
    assert candidates(cache).shift_horizons == pytest.approx(2**0.25)


def test_an_eviction_every_order_agrees_on_opens_no_duel() -> None:
    """Both leaves class 0: recency and frequency evict the same one, so its return teaches nothing."""
    cache, clock = make_cache(8)
    for t, prompt in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
        clock.now = float(t)
        serve(cache, prompt)
    clock.now = 3.0
    cache.match_prefix(RadixKey([1, 2, 3, 4]))
    assert candidates(cache).shift_horizons == 1.0 and candidates(cache).shift == 0.0


def test_a_ghost_hit_restores_the_count_the_node_had_when_evicted() -> None:
    """Frequency outlives eviction: a popular prompt pushed out by a burst comes back protected."""
    cache, clock = make_cache(8)
    for t in range(3):
        clock.now = float(t)
        serve(cache, [1, 2, 3, 4])  # two reuses
    clock.now = 3.0
    serve(cache, [5, 6, 7, 8])
    serve(cache, [9, 10, 11, 12])  # LRU at shift 0: [1..4] (older) goes, with its 2 hits in its ghost
    assert cache.cached_len(RadixKey([1, 2, 3, 4])) == 0
    clock.now = 4.0
    serve(cache, [1, 2, 3, 4])  # misses where the ghost is, then comes back
    node = next(n for n in cache.nodes() if n.key.token_ids[0] == 1)
    assert node.hit_count == 2 and candidates(cache).class_of(node) == 2  # protected as before, not class 0


def test_a_split_tail_leaves_its_ghost_below_the_split() -> None:
    """A split hangs the tail below the new node under a new child key: its ghost is where a later lookup stops."""
    cache, clock = make_cache(8)
    for t in range(3):
        clock.now = float(t)
        serve(cache, [1, 2, 3, 4], "tenant")  # two reuses
    clock.now = 3.0
    req = start(cache, [1, 2, 5, 6], "tenant")  # splits [1..4] at 2 and locks [1, 2]: [3, 4] is the only candidate
    (tail,) = [n for n in cache.nodes() if n.key.token_ids[0] == 3]
    assert cache.evict(2) == 2 and tail.hit_count == 2
    cache.cache_finished_req(req)
    cache.check_invariants()
    clock.now = 4.0
    serve(cache, [1, 2, 3, 4], "tenant")  # misses below [1, 2], where the ghost is, then comes back
    (node,) = [n for n in cache.nodes() if n.key.token_ids[0] == 3]
    assert node.hit_count == 2  # the ghost was found under the split node and the tail's first token


def test_hit_classes_are_log2_buckets() -> None:
    assert [hit_class(h, 4) for h in (0, 1, 2, 3, 4, 7, 8, 1000)] == [0, 1, 2, 2, 3, 3, 3, 3]
    for num_classes in range(2, 7):  # the heaps' table (no call on the hot path) says the same
        heaps: ClassHeaps[TreeNode] = ClassHeaps(num_classes, lambda n: n.id, True)
        for hits in range(300):
            table = heaps.classes[hits] if hits < heaps.top_class_hits else heaps.top_class
            assert table == hit_class(hits, num_classes)
    with pytest.raises(ValueError, match="num_classes"):
        AdaptiveCandidates(lambda n: 0, lambda n: n, lambda n: 1, lambda: 0.0, 16, num_classes=1)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()), min_size=5, max_size=60),
    shift=st.sampled_from([0.0, 1.0, 5.0, 100.0]),
    depth_shift=st.sampled_from([0.0, 2.0, float("inf")]),
)
def test_never_evicts_a_locked_or_interior_node(
    ops: list[tuple[int, int, bool]], shift: float, depth_shift: float
) -> None:
    """Prompts from 6 stems x 4 tails, some kept running (locked): every victim is an unlocked leaf."""
    cache, clock = make_cache(48)
    real_pop, running = cache.candidates.pop, []

    def checked_pop() -> TreeNode | None:
        victim = real_pop()
        assert victim is None or (victim.lock_ref == 0 and not victim.children), f"evicted {victim!r}"
        return victim

    cache.candidates.pop = checked_pop  # type: ignore[method-assign]
    for t, (stem, tail, keep) in enumerate(ops):
        clock.now = float(t)
        candidates(cache).shift, candidates(cache).depth_shift = shift, depth_shift
        prompt = [100 + stem] * 3 + [200 + tail] * 2 + [300 + t]
        if keep and len(running) < 3:
            running.append(start(cache, prompt))
        elif cache.evictable_size() + cache.allocator.free_size() >= len(prompt):
            serve(cache, prompt)
        cache.check_invariants()
    for req in running:
        cache.cache_finished_req(req)
    cache.check_invariants()


def depth_duel_setup(depth_shift: float) -> tuple[RadixCache, Clock, tuple[int, ...]]:
    """Below [1, 2]: [3, 4] (old, shallow) and [9, 10] (new, deeper, under [5..8]); evict one of them.

    Deepest first (``depth_shift`` oo) evicts [9, 10]; recency across depths (``depth_shift`` 0) evicts [3, 4].
    The two orders disagree: a depth duel opens between the victim and the other leaf. Returns the victim.
    """
    cache, clock = make_cache(10)
    for t, prompt in enumerate(([1, 2, 3, 4], [1, 2, 5, 6, 7, 8], [1, 2, 5, 6, 7, 8, 9, 10])):
        clock.now = float(t)
        serve(cache, prompt)
    candidates(cache).depth_shift = depth_shift
    clock.now = 3.0
    before = {tuple(n.key.token_ids.tolist()) for n in cache.nodes()}
    cache.evict(2)
    (victim,) = before - {tuple(n.key.token_ids.tolist()) for n in cache.nodes()}
    assert candidates(cache).depth_shift_horizons == 1.0
    return cache, clock, victim


@pytest.mark.parametrize("depth_shift", [float("inf"), 0.0])
def test_the_evicted_leaf_asked_for_first_moves_the_depth_shift_its_way(depth_shift: float) -> None:
    """The victim comes back first: the order that would have kept it was right, the depth shift moves to it."""
    cache, clock, victim = depth_duel_setup(depth_shift)
    assert victim == ((9, 10) if depth_shift else (3, 4))
    clock.now = 4.0
    cache.match_prefix(RadixKey([1, 2, 5, 6, 7, 8, 9, 10] if depth_shift else [1, 2, 3, 4]))
    expected = 2**-0.25 if depth_shift else 2**0.25  # deepest first erred: less depth shift; else more
    assert candidates(cache).depth_shift_horizons == pytest.approx(expected)
    assert candidates(cache).depth_shift < float("inf")


@pytest.mark.parametrize("depth_shift", [float("inf"), 0.0])
def test_the_kept_leaf_asked_for_first_keeps_the_order_that_kept_it(depth_shift: float) -> None:
    cache, clock, victim = depth_duel_setup(depth_shift)
    clock.now = 4.0
    kept = [1, 2, 3, 4] if depth_shift else [1, 2, 5, 6, 7, 8, 9, 10]
    assert len(cache.match_prefix(RadixKey(kept)).indices) == len(kept)
    expected = 2**0.25 if depth_shift else 2**-0.25
    assert candidates(cache).depth_shift_horizons == pytest.approx(expected)
