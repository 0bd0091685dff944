"""RadixCache against a brute-force reference, every invariant after every step.

The reference is a dict from (namespace, page-aligned prefix) to the slots of
that prefix's last page: what a cache *should* hold, maintained without a tree.
Keys are built from a small alphabet of page-sized chunks plus a short tail, so
requests collide, diverge mid-edge and share pages (uniform random tokens
would almost never do that and would miss the real bugs).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from radixserve.cache import EVICTION_POLICIES, CacheReq, KVEvent, KVEventLog, RadixCache, RadixKey, TreeNode
from radixserve.cache.core.radix_check import check_slot_conservation
from radixserve.memory import TokenAllocator
from tests.cache.helpers import counter_clock
from tests.machine_settings import machine_settings

PageKey = tuple[str | None, tuple[int, ...]]

# The eviction order each policy promises, written independently of policy.py.
EXPECTED_RANK: dict[str, Any] = {
    "lru": lambda n: (n.last_access_time, n.id),
    "mru": lambda n: (-n.last_access_time, n.id),
    "fifo": lambda n: (n.creation_time, n.id),
    "filo": lambda n: (-n.creation_time, n.id),
    "lfu": lambda n: (n.hit_count, n.last_access_time, n.id),
    "slru": lambda n: (n.hit_count >= 1, n.last_access_time, n.id),
    "priority": lambda n: (n.priority, n.last_access_time, n.id),
}


def slow_depth(n: TreeNode) -> int:
    """Tokens above ``n``, counted the slow way (the root's key is empty)."""
    depth, cursor = 0, n.parent
    while cursor is not None:
        depth += len(cursor.key)
        cursor = cursor.parent
    return depth


def learned_victim(leaves: list[TreeNode], share: float, top_share: float) -> TreeNode:
    """The leaf ``learned`` evicts (nested ARC): from the never-reused leaves while they hold more than ``share``
    of the candidates' tokens, else the least recent reused one; among the never-reused, the least recent at the
    top level while those hold more than ``top_share`` of them, else the deepest below (least recent on a tie)."""
    reused = [n for n in leaves if n.hit_count > 0]
    top = [n for n in leaves if n.hit_count == 0 and slow_depth(n) == 0]
    below = [n for n in leaves if n.hit_count == 0 and slow_depth(n) > 0]
    top_len, below_len = sum(len(n.value) for n in top), sum(len(n.value) for n in below)
    once_len = top_len + below_len
    if not (top or below) or (reused and once_len <= share * (once_len + sum(len(n.value) for n in reused))):
        return min(reused, key=EXPECTED_RANK["lru"])
    if not below or (top and top_len > top_share * once_len):
        return min(top, key=EXPECTED_RANK["lru"])
    return min(below, key=lambda n: (-slow_depth(n), n.last_access_time, n.id))


def adaptive_victim(leaves: list[TreeNode], shifts: tuple[float, float, float], num_classes: int) -> TreeNode:
    """The leaf ``adaptive`` evicts: by groups (the top level, below it), each ranked by shifted recency.

    Shifted recency: last access + class * shift, class 0 for a never-reused leaf, else 1 + floor(log2(hits))
    capped at ``num_classes - 1``. Below the top level the deepest leaf goes first, unless the least recently
    used leaf there is older by ``depth_shift`` (shifted recency of both); the two groups' picks are compared
    by shifted recency, the top level's plus ``top_shift``.
    """
    shift, top_shift, depth_shift = shifts

    def shifted(n: TreeNode) -> float:
        return n.last_access_time + min(n.hit_count.bit_length(), num_classes - 1) * shift

    def deepest(n: TreeNode) -> tuple[float, float, int]:
        return (-slow_depth(n), shifted(n), n.id)

    top = min((n for n in leaves if slow_depth(n) == 0), key=deepest, default=None)
    below = min((n for n in leaves if slow_depth(n) > 0), key=deepest, default=None)
    if below is not None:
        old = min((n for n in leaves if slow_depth(n) > 0), key=lambda n: (n.last_access_time, n.id))
        below = old if shifted(old) + depth_shift < shifted(below) else below
    if below is not None and (top is None or shifted(below) < shifted(top) + top_shift):
        return below
    assert top is not None
    return top


def when_victim(leaves: list[TreeNode], table: Any, scored: bool, now: float) -> TreeNode:
    """The leaf ``when`` evicts: of each class's (reuses 0 / 1 / 2-3 / 4-7 / 8+, top level or below) least and
    most recently used leaf, the lowest P(read within the horizon) for its class and age bin (half octaves from
    2**-6, 56 bins), the least recent on a tie; all P are 0 before a pool's worth was evicted (LRU)."""

    def cls(n: TreeNode) -> int:
        reuses = n.hit_count
        bucket = 0 if reuses == 0 else 1 if reuses == 1 else 2 if reuses < 4 else 3 if reuses < 8 else 4
        return 2 * bucket + (slow_depth(n) > 0)

    def age_bin(age: float) -> int:
        return 0 if age <= 0 else min(max(math.floor(2 * (math.log2(age) + 6)), 0), 55)

    ends = []
    for c in {cls(n) for n in leaves}:
        group = [n for n in leaves if cls(n) == c]
        ends.append(min(group, key=lambda n: (n.last_access_time, n.id)))
        ends.append(min(group, key=lambda n: (-n.last_access_time, n.id)))

    def score(n: TreeNode) -> tuple[float, float, int]:
        p = float(table[cls(n)][age_bin(now - n.last_access_time)]) if scored else 0.0
        return (p, n.last_access_time, n.id)

    return min(ends, key=score)


def key_strategy(page_size: int) -> st.SearchStrategy[tuple[str | None, list[int]]]:
    # Chunks 0 and 1 agree on all but their last token: divergence inside a page.
    base = list(range(1, page_size + 1))
    chunks = [base, base[:-1] + [90], [50 + i for i in range(page_size)], [70] * page_size]
    body = st.lists(st.sampled_from(chunks), min_size=1, max_size=5).map(lambda cs: [t for c in cs for t in c])
    tail = st.lists(st.integers(1, 3), max_size=page_size + 1)
    namespace = st.sampled_from([None, "a", "b"])
    return st.tuples(namespace, st.tuples(body, tail).map(lambda bt: bt[0] + bt[1]))


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.allocator = TokenAllocator(24 * self.page_size, self.page_size)
        self.cache = RadixCache(
            self.allocator, self.page_size, self.policy, counter_clock(), listeners=[KVEventLog(self.page_size)]
        )
        self.model: dict[PageKey, list[int]] = {}
        self.hits: dict[PageKey, int] = {}  # finished inserts that found the page already cached
        self.priority: dict[PageKey, int] = {}
        self.live: list[CacheReq] = []
        self.expected_victims: list[PageKey] | None = None
        if self.policy == "when":  # its table changes only in the learn_table rule: the brute force can follow
            self.cache.candidates.frozen = True  # type: ignore[attr-defined]
        self.real_evict = self.cache.evict
        self.cache.evict = self.checked_evict  # type: ignore[method-assign]

    def checked_evict(self, num_tokens: int) -> int:
        """Every eviction, also those inside alloc_slots, is checked against the brute-force order."""
        self.apply_events(self.cache.events.drain() if self.cache.events else [])
        self.expected_victims = self.simulate_eviction(num_tokens)
        before = self.cache.evictable_size()
        evicted = self.real_evict(num_tokens)
        assert evicted >= min(num_tokens, before) and evicted <= before
        assert evicted >= num_tokens or self.cache.evictable_size() == 0
        self.apply_events(self.cache.events.drain() if self.cache.events else [])
        return evicted

    # ---- the reference ------------------------------------------------------------------------

    def pages_of(self, ns: str | None, token_ids: np.ndarray) -> list[PageKey]:
        p = self.page_size
        return [(ns, tuple(token_ids[:end].tolist())) for end in range(p, len(token_ids) - len(token_ids) % p + 1, p)]

    def expected_match(self, ns: str | None, token_ids: np.ndarray) -> list[int]:
        slots: list[int] = []
        for page in self.pages_of(ns, token_ids):
            if page not in self.model:
                break
            slots += self.model[page]
        return slots

    def model_insert(self, req: CacheReq, count_hit: bool = True) -> None:
        p = self.page_size
        for i, page in enumerate(self.pages_of(req.extra_key, req.token_ids)):
            if page in self.model:
                self.hits[page] += count_hit
                self.priority[page] = max(self.priority[page], req.priority)
            else:
                self.model[page] = req.kv_indices[i * p : (i + 1) * p].tolist()
                self.hits[page], self.priority[page] = 0, req.priority

    def locked_pages(self) -> set[PageKey]:
        return {pg for r in self.live for pg in self.pages_of(r.extra_key, r.token_ids[: r.cache_protected_len])}

    def apply_events(self, events: list[KVEvent]) -> None:
        locked = self.locked_pages()
        removed: list[PageKey] = []
        for event in events:
            pages = self.pages_of(event.extra_key, event.key.token_ids)[event.start // self.page_size :]
            assert len(event.block_hashes) == len(pages)
            if event.kind == "store":
                assert all(pg in self.model for pg in pages), "store event for pages the model lacks"
                continue
            for page in reversed(pages):
                assert page not in locked, f"evicted a locked page {page}"
                assert not any(
                    k[0] == page[0] and len(k[1]) > len(page[1]) and k[1][: len(page[1])] == page[1] for k in self.model
                ), "evicted a page that still had cached descendants"
                del self.model[page], self.hits[page], self.priority[page]
            removed.append(pages[0])
        if self.expected_victims is not None:
            assert removed == self.expected_victims, "eviction order differs from the policy"
            self.expected_victims = None

    def simulate_eviction(self, num_tokens: int) -> list[PageKey]:
        """Brute force: repeatedly take the best-ranked unlocked leaf, as the policy says."""
        learned = self.cache.candidates
        shifts = (learned.shift, learned.top_shift, learned.depth_shift) if self.policy == "adaptive" else None
        nodes = list(self.cache.nodes())
        alive = {n.id: len(n.children) for n in nodes}
        leaves = [n for n in nodes if n.lock_ref == 0 and not n.children]
        order, freed = [], 0
        window = [n for _, n in learned.evictions] if self.policy == "when" else []  # type: ignore[attr-defined]
        while leaves and freed < num_tokens:
            if self.policy == "when":  # scored once the last evictions hold a pool's worth of tokens
                scored = sum(window) >= self.allocator.size
                victim = when_victim(leaves, learned.table, scored, learned.now)  # type: ignore[attr-defined]
                window.append(len(victim.key))
                while sum(window) - window[0] >= self.allocator.size:
                    window.pop(0)
            elif shifts:
                victim = adaptive_victim(leaves, shifts, learned.num_classes)  # type: ignore[attr-defined]
            elif self.policy == "learned":
                victim = learned_victim(leaves, learned.share, learned.top_share)  # type: ignore[attr-defined]
            elif self.policy == "minisim":  # the fixed policy its shadows chose
                victim = min(leaves, key=EXPECTED_RANK[learned.choice])  # type: ignore[attr-defined]
            else:
                victim = min(leaves, key=EXPECTED_RANK[self.policy])
            leaves.remove(victim)
            order.append(self.page_key(victim))
            freed += len(victim.key)
            parent = victim.parent
            assert parent is not None
            if parent is not self.cache.root:
                alive[parent.id] -= 1
                if alive[parent.id] == 0 and parent.lock_ref == 0:
                    leaves.append(parent)
        return order

    def page_key(self, node: TreeNode) -> PageKey:
        path = self.cache.path_key(node).token_ids
        start = len(path) - len(node.key)
        return (node.key.extra_key, tuple(path[: start + self.page_size].tolist()))

    # ---- rules --------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < 4)
    @rule(data=st.data())
    def open_request(self, data: st.DataObject) -> None:
        ns, token_ids = data.draw(key_strategy(self.page_size))
        arr = np.asarray(token_ids, dtype=np.int64)
        expected = self.expected_match(ns, arr)
        req = self.cache.open_request(RadixKey(arr, ns), priority=data.draw(st.integers(0, 2)))
        assert req.kv_indices.tolist() == expected, "match differs from brute force"
        if self.cache.extend_request(req, arr[len(expected) :]):
            self.live.append(req)
        else:
            self.cache.cache_finished_req(req, is_insert=False)

    @rule(data=st.data())
    def serve_request(self, data: st.DataObject) -> None:
        """A whole request at once: the common case, and what grows the tree."""
        ns, token_ids = data.draw(key_strategy(self.page_size))
        arr = np.asarray(token_ids, dtype=np.int64)
        req = self.cache.open_request(RadixKey(arr, ns), priority=data.draw(st.integers(0, 2)))
        assert req.kv_indices.tolist() == self.expected_match(ns, arr), "match differs from brute force"
        if self.cache.extend_request(req, arr[len(req.kv_indices) :]):
            self.model_insert(req)
            self.cache.cache_finished_req(req)
        else:
            self.cache.cache_finished_req(req, is_insert=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), is_insert=st.booleans())
    def finish_request(self, data: st.DataObject, is_insert: bool) -> None:
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        if is_insert:
            self.model_insert(req)
        self.cache.cache_finished_req(req, is_insert=is_insert)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), more=st.lists(st.integers(1, 3), max_size=3))
    def chunk_request(self, data: st.DataObject, more: list[int]) -> None:
        req = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        self.model_insert(req, count_hit=False)
        self.cache.cache_unfinished_req(req)
        assert req.kv_indices.tolist()[: req.cache_protected_len] == self.expected_match(
            req.extra_key, req.token_ids[: req.cache_protected_len]
        )
        self.cache.extend_request(req, np.asarray(more, dtype=np.int64))

    @rule(num_pages=st.integers(0, 3))
    def evict(self, num_pages: int) -> None:
        self.cache.evict(num_pages * self.page_size)

    @precondition(lambda self: self.policy == "adaptive")
    @rule(
        shift=st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.0, 40.0]),
        top_shift=st.sampled_from([0.0, 1.0, 5.0, 40.0]),
        depth_shift=st.sampled_from([0.0, 1.0, 4.0, float("inf")]),
    )
    def learn(self, shift: float, top_shift: float, depth_shift: float) -> None:
        """Stand in for what the ghosts and duels would have taught: any shifts must keep the order exact."""
        self.cache.candidates.shift = shift  # type: ignore[attr-defined]
        self.cache.candidates.top_shift = top_shift  # type: ignore[attr-defined]
        self.cache.candidates.depth_shift = depth_shift  # type: ignore[attr-defined]

    @precondition(lambda self: self.policy == "learned")
    @rule(share=st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]), top_share=st.sampled_from([0.0, 0.3, 0.5, 1.0]))
    def learn_share(self, share: float, top_share: float) -> None:
        """Stand in for what the ghosts would have taught: any shares must keep the order exact."""
        self.cache.candidates.share = share  # type: ignore[attr-defined]
        self.cache.candidates.top_share = top_share  # type: ignore[attr-defined]

    @precondition(lambda self: self.policy == "minisim")
    @rule(name=st.sampled_from(["lru", "lfu", "slru"]))
    def choose(self, name: str) -> None:
        """Stand in for what the shadows would have chosen: a switch of order keeps every leaf a candidate."""
        self.cache.candidates.choose(name)  # type: ignore[attr-defined]

    @precondition(lambda self: self.policy == "when")
    @rule(
        levels=st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=20, max_size=20),
        cuts=st.lists(st.integers(0, 56), min_size=10, max_size=10),
    )
    def learn_table(self, levels: list[float], cuts: list[int]) -> None:
        """Stand in for what the gaps would have taught: any table (per class one level below an age, another
        above) must keep the order exact."""
        table = self.cache.candidates.table  # type: ignore[attr-defined]
        for c in range(10):
            table[c, : cuts[c]], table[c, cuts[c] :] = levels[2 * c], levels[2 * c + 1]

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ns, token_ids = data.draw(key_strategy(self.page_size))
        indices, node = self.cache.match_prefix(RadixKey(token_ids, ns))
        assert indices.tolist() == self.expected_match(ns, np.asarray(token_ids, dtype=np.int64))

    # ---- checked after every step ----------------------------------------------------------------

    @invariant()
    def everything_holds(self) -> None:
        self.apply_events(self.cache.events.drain() if self.cache.events else [])
        self.cache.check_invariants()
        check_slot_conservation(self.cache, self.live)
        tree = {}
        for node in self.cache.nodes():
            path = self.cache.path_key(node).token_ids
            start = len(path) - len(node.key)
            for i, page in enumerate(self.pages_of(node.key.extra_key, path)[start // self.page_size :]):
                tree[page] = node.value[i * self.page_size : (i + 1) * self.page_size].tolist()
                hits = self.hits.get(page, -1)
                if self.policy == "adaptive":  # a node back where a missed ghost was resumes the ghost's count
                    assert 0 <= hits <= node.hit_count, f"{node!r}: hit_count {node.hit_count} < {hits}"
                else:
                    assert hits == node.hit_count, f"{node!r}: hit_count {node.hit_count}"
                assert self.priority.get(page) == node.priority, f"{node!r}: priority {node.priority}"
        assert tree == self.model, "the tree's content differs from the reference"

    def teardown(self) -> None:
        for req in self.live:
            self.cache.cache_finished_req(req)
        self.cache.check_invariants()
        check_slot_conservation(self.cache, [])


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_radix_cache_matches_reference(page_size: int, policy: str) -> None:
    machine = type("Machine", (RadixMachine,), {"page_size": page_size, "policy": policy})
    run_state_machine_as_test(machine, settings=machine_settings(25, 40))
