"""Structural checks and printing for RadixCache, kept out of the tree's hot module.

``check_radix_invariants`` walks the whole tree (O(n)) and checks every invariant
the tree alone can answer; tests call it after every step. They are:

- the root is permanently locked (``lock_ref >= 1``), so it is never an eviction candidate;
- every child is stored under the child key recomputed from its edge, and its edge
  is a whole, non-zero number of pages with one slot per token;
- an edge lies in one namespace, and a namespace starts (below a shared head) but
  never ends inside a path: different ``extra_key`` values never share a node;
- ``depth`` is the number of tokens above a node's first token;
- ``lock_ref`` is never negative and never below the sum of its children's;
- ``evictable_size + protected_size`` equals the tokens in the tree, split by lock;
- the eviction candidates are exactly the unlocked leaves (and the candidate
  structure's own order holds: ``CandidateSet.check``);
- no slot is held by two nodes, and no cached slot is on the allocator's free list.

Slot conservation across allocator, cache and requests (every slot in exactly one
place) needs the live requests too: ``check_slot_conservation``. Who owns which
slot of a request is drawn in base.py; ``match_prefix`` against a brute-force
reference is the state machine's job (tests/cache/core/test_radix_machine.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.core.base import BasePrefixCache, CacheReq

if TYPE_CHECKING:
    from radixserve.cache.core.radix import RadixCache, TreeNode


def check_radix_invariants(cache: RadixCache) -> None:
    root, page = cache.root, cache.page_size
    assert root.lock_ref >= 1, "the root lost its permanent lock"
    evictable = protected = 0
    expected_candidates = set()
    for node in cache.nodes():
        parent = node.parent
        assert parent is not None, f"{node!r} has no parent"
        assert parent.children.get(node.key.child_key(page)) is node, (
            f"{node!r} is not stored under its recomputed child_key"
        )
        assert len(node.key) > 0 and len(node.key) % page == 0, f"{node!r}: edge not whole pages"
        assert len(node.key) == len(node.value), f"{node!r}: {len(node.key)} tokens, {len(node.value)} slots"
        assert node.key.is_pure, f"{node!r}: an edge spans two namespaces"
        assert node.depth == parent.depth + len(parent.key), f"{node!r}: depth {node.depth} != tokens above it"
        if parent is not root:  # a namespace may start below the shared namespace (a shared head), never end
            assert parent.key.extra_key in (None, node.key.extra_key), f"{node!r} crosses namespaces"
        assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
        child_locks = sum(child.lock_ref for child in node.children.values())
        assert node.lock_ref >= child_locks, f"{node!r}: lock_ref below its children's ({child_locks})"
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if not node.children:
                expected_candidates.add(node)
    assert evictable == cache.evictable_size(), f"evictable_size {cache.evictable_size()} != {evictable}"
    assert protected == cache.protected_size(), f"protected_size {cache.protected_size()} != {protected}"
    assert set(cache.candidates) == expected_candidates, "candidate set != unlocked leaves"
    cache.candidates.check()
    slots = cache.cached_slots()
    assert len(np.unique(slots)) == len(slots), "a KV slot is held by two nodes"
    assert not cache.allocator.is_free(slots).any(), "a cached slot is also on the free list"


def check_slot_conservation(cache: BasePrefixCache, live: Iterable[CacheReq]) -> None:
    """Every slot is in exactly one place: free list, cache, or a live request's private pages."""
    allocator = cache.allocator
    page = allocator.page_size
    owned = [allocator.free_slots(), cache.cached_slots()]
    for req in live:
        private_pages = np.unique(req.kv_indices[req.cache_protected_len :] // page)
        owned.append((private_pages[:, None] * page + np.arange(page)).reshape(-1))
    everything = np.concatenate(owned)
    assert len(everything) == allocator.size, f"{len(everything)} slots accounted for, pool has {allocator.size}"
    assert len(np.unique(everything)) == allocator.size, "a slot is in two places at once"


def format_tree(cache: RadixCache) -> str:
    """One line per node: indent by depth, edge length, first tokens, lock_ref."""
    lines: list[str] = []

    def visit(node: TreeNode, depth: int) -> None:
        for child_key, child in node.children.items():
            assert child_key == child.key.child_key(cache.page_size), f"bad child key for {child!r}"
            head = child.key.token_ids[:10].tolist()
            more = "..." if len(child.key) > 10 else ""
            ns = f" ns={child.key.extra_key!r}" if child.key.extra_key is not None else ""
            lines.append(f"{'  ' * depth}{len(child.key)} {head}{more} r={child.lock_ref}{ns}")
            visit(child, depth + 1)

    lines.append(
        f"root r={cache.root.lock_ref} (evictable={cache.evictable_size()} protected={cache.protected_size()})"
    )
    visit(cache.root, 1)
    return "\n".join(lines)
