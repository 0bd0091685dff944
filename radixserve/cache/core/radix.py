"""RadixCache: a radix tree over token sequences whose nodes hold KV slot indices.

Every edge carries a run of tokens (a whole number of pages) and one slot per
token; a node boundary is exactly where two cached sequences stopped agreeing.
The tree holds indices only: a split copies 8 bytes per token, never KV.

Sizes: every cached token is either evictable (its node has lock_ref == 0) or
protected; the counters change only in lock, unlock, insert and delete.
Eviction candidates are the unlocked leaves, kept ranked incrementally
(``CandidateHeap``), so evicting k tokens costs O(k log n).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.core.base import EMPTY_INDICES, BasePrefixCache, MatchResult
from radixserve.cache.core.candidates import CandidateSet
from radixserve.cache.core.key import RadixKey
from radixserve.cache.core.listener import CacheListener
from radixserve.cache.core.policy import CandidateHooks, EvictionStrategy, create_eviction_strategy
from radixserve.memory.allocator import IndexArray, TokenAllocator

if TYPE_CHECKING:
    from radixserve.cache.tiers.index import TierIndex

Clock = Callable[[], float]


class TreeNode:
    __slots__ = (
        "id",
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access_time",
        "creation_time",
        "hit_count",
        "priority",
        "depth",
        "child_key",
        "turn",
        "ends",
    )

    def __init__(self, node_id: int, key: RadixKey, value: IndexArray, parent: TreeNode | None, now: float) -> None:
        self.id = node_id
        self.key = key  # the edge from the parent: a whole number of pages
        self.value = value  # one KV slot per token of key
        self.parent = parent
        self.children: dict[object, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0  # finished requests that reused this node's tokens
        self.priority = 0  # max request priority among the inserts that passed through
        self.depth: int = parent.depth + len(parent.key) if parent is not None else 0  # tokens above key[0]
        # Where the parent keeps it (``key.child_key``), set when it is linked: deleting it and its ghost
        # key (the adaptive policy's, on every eviction and new leaf) need no recomputation.
        self.child_key: Hashable = None
        # A conversation's turn: the finished requests whose insert ended on the path above this node, and
        # ``ends``, those that ended on this node. A new node continues the turns that ended where it hangs when
        # it is the parent's first or second branch (beside a predecessor's cut-off partial page); a third is
        # another conversation on a shared head (a system prompt), whatever ended there.
        self.turn: int = 0 if parent is None else parent.turn + (parent.ends if len(parent.children) <= 1 else 0)
        self.ends: int = 0

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(BasePrefixCache[TreeNode]):
    """The radix-tree prefix cache (``--prefix-cache radix``, the default)."""

    def __init__(
        self,
        allocator: TokenAllocator,
        page_size: int = 1,
        eviction_policy: str | EvictionStrategy = "lru",
        clock: Clock | None = None,
        listeners: Sequence[CacheListener] = (),
        tiers: TierIndex | None = None,
    ) -> None:
        super().__init__(allocator, page_size, listeners, tiers)
        # A name from EVICTION_POLICIES, or a strategy object (the benchmarks' offline bound).
        if isinstance(eviction_policy, EvictionStrategy):
            self.strategy, self.eviction_policy = eviction_policy, type(eviction_policy).__name__
        else:
            self.strategy, self.eviction_policy = create_eviction_strategy(eviction_policy), eviction_policy
        self.clock: Clock = clock or time.monotonic
        self._clear()

    def _clear(self) -> None:
        self._ids = itertools.count()
        self.root = TreeNode(next(self._ids), RadixKey([]), EMPTY_INDICES, None, self.clock())
        self.root.lock_ref = 1  # permanently locked: never a candidate, ends every lock walk
        self._evictable_size = 0
        self._protected_size = 0
        hooks = CandidateHooks(_ghost_key, _node_len, self.clock, self.allocator.size)
        tie_break = attrgetter("id")  # a C-level getter: no Python frame per heap push
        self.candidates: CandidateSet[TreeNode] = self.strategy.candidate_set(tie_break, hooks)

    # ---- match / insert ---------------------------------------------------------------------

    def match_prefix(self, key: RadixKey) -> MatchResult[TreeNode]:
        """Longest cached prefix of ``key``, page-aligned; refreshes the path's access time.

        Mutates: a divergence inside an edge splits that node, so the returned
        ``last_node`` ends exactly at the match. Lock it before the returned
        indices are used: until then eviction may free them.
        """
        key = key[: len(key) - len(key) % self.page_size].aligned(self.page_size)
        now = self.clock()
        self.candidates.note_lookup(key, now)
        node, values = self.root, []
        self.root.last_access_time = now
        while len(key):
            child_key = key.child_key(self.page_size)
            child = node.children.get(child_key)
            if child is None:
                self.candidates.note_miss((node.id, child_key), now)  # an adaptive policy learns here
                break
            matched = child.key.match(key, self.page_size)
            if matched < len(child.key):
                if matched:  # only the matched part was accessed: the tail keeps its rank
                    node = self._split(child, matched)
                    self._touch(node, now)
                    values.append(node.value)
                break
            self._touch(child, now)
            values.append(child.value)
            node, key = child, key[matched:]
        if not values:
            return MatchResult(EMPTY_INDICES, node)
        indices = values[0] if len(values) == 1 else np.concatenate(values)
        return MatchResult(indices, node)

    def cached_len(self, key: RadixKey) -> int:
        """Tokens of ``key`` the tree holds, page-aligned; read only (no split, touch or miss noted)."""
        key = key[: len(key) - len(key) % self.page_size].aligned(self.page_size)
        node, total = self.root, 0
        while len(key):
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            matched = child.key.match(key, self.page_size)
            total += matched
            if matched < len(child.key):
                break
            node, key = child, key[matched:]
        return total

    def insert(self, key: RadixKey, indices: IndexArray, priority: int = 0, count_hit: bool = True) -> int:
        """Cache ``key`` -> ``indices``; return the length already cached (see base class).

        Mutates (may split). Takes ownership of ``indices[returned:]`` (copied).
        Every node on the path gets ``priority`` (max) and, if ``count_hit``,
        one more hit: a hit is a finished request reusing the node's tokens.
        """
        if len(key) != len(indices) or len(key) % self.page_size:
            raise ValueError(f"insert needs page-aligned key and indices of one length: {len(key)}, {len(indices)}")
        key = key.aligned(self.page_size)
        full, now = key.token_ids, self.clock()
        if count_hit:  # a finished request's whole sequence (not a chunk of one still running)
            self.candidates.note_finished(key, now)
        node, matched_len = self.root, 0
        while matched_len < len(full):
            rest = key[matched_len:]
            child = node.children.get(rest.child_key(self.page_size))
            if child is None:
                break
            matched = child.key.match(rest, self.page_size)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.priority = max(child.priority, priority)
            child.hit_count += count_hit
            self._touch(child, now)
            node, matched_len = child, matched_len + matched
        if matched_len < len(full):
            rest, value = key[matched_len:], indices[matched_len:].copy()
            head = rest.head_len
            if head < len(rest):  # a shared head ends here: one leaf per namespace
                node = self._add_leaf(node, rest[:head].pure(), value[:head], priority, now)
                rest, value = rest[head:], value[head:]
            node = self._add_leaf(node, rest.pure(), value, priority, now)
            self._inserted(key, indices, matched_len)
        if count_hit and node is not self.root:  # a finished request's turn ended here
            node.ends += 1
        return matched_len

    # ---- eviction ---------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, lowest rank first, until ``num_tokens`` slots are freed.

        A parent left as an unlocked leaf joins the candidates at once, so a
        dead branch is evicted bottom-up within one call. Returns the number of
        slots freed (whole nodes, so possibly more than asked; fewer only when
        nothing evictable is left). A strategy may free only a leaf's tail
        (``EvictionStrategy.evict_len``): the leaf is split there first.
        """
        evicted, freed = 0, []
        while evicted < num_tokens:
            node = self.candidates.pop()
            if node is None:
                break
            tail = self.strategy.evict_len(node, len(node.value), num_tokens - evicted)
            if 0 < tail < len(node.value):
                tail = -(-tail // self.page_size) * self.page_size  # whole pages
                if tail < len(node.value):
                    self._split(node, len(node.value) - tail)  # ``node`` keeps the tail and stays a leaf
            if self._listeners:  # before the slots are freed: the tiers copy their K/V down
                path, slots = self._path_key_slots(node)
                self._evicting(path, slots, len(path) - len(node.key))
            freed.append(node.value)
            evicted += len(node.value)
            self._delete_leaf(node)
        if freed:  # one allocator call for the whole batch
            self.allocator.free(freed[0] if len(freed) == 1 else np.concatenate(freed))
        self.evicted_tokens += evicted
        return evicted

    # ---- locking ----------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and every ancestor; return the (non-positive) evictable-size delta."""
        delta = 0
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.root:  # the root's parent is None
            if cursor.lock_ref == 0:
                self._evictable_size -= len(cursor.key)
                self._protected_size += len(cursor.key)
                delta -= len(cursor.key)
                if not cursor.children:  # only a leaf can be a candidate: no call for the path above it
                    self.candidates.discard(cursor)
            cursor.lock_ref += 1
            cursor = cursor.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``; return the (non-negative) evictable-size delta."""
        delta = 0
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.root:
            if cursor.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {cursor!r}: unbalanced lock")
            cursor.lock_ref -= 1
            if cursor.lock_ref == 0:
                self._evictable_size += len(cursor.key)
                self._protected_size -= len(cursor.key)
                delta += len(cursor.key)
                if not cursor.children:  # an unlocked leaf: a candidate again (an interior node never is)
                    self.candidates.add(cursor)
            cursor = cursor.parent
        return delta

    # ---- walking ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_key(self, node: TreeNode) -> RadixKey:
        """The whole cached sequence ending at ``node``: its tokens from the root, in their namespace (with
        the shared head above it, if any). Read only; O(depth in nodes). For listeners, summaries, and
        strategies that rank a leaf by what it holds (the benchmarks' Belady bound)."""
        edges = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.root:
            edges.append(cursor.key)
            cursor = cursor.parent
        return RadixKey.join(edges[::-1])

    def flush_to_disk(self) -> None:
        """Shutdown: queue every cached page (L1 and L2) that the disk tier lacks."""
        if self.tiers is None:
            return
        for node in self.nodes():
            if not node.children:  # a leaf's path covers all its ancestors
                self.tiers.flush_path(*self._path_key_slots(node))
        self.tiers.flush_host()

    def cached_slots(self) -> IndexArray:
        values = [node.value for node in self.nodes()]
        return np.concatenate(values) if values else EMPTY_INDICES

    def check_invariants(self) -> None:
        from radixserve.cache.core.radix_check import check_radix_invariants

        check_radix_invariants(self)
        for node in self.nodes():
            assert node.parent is not None and node.parent.children.get(node.child_key) is node, f"{node!r}: child_key"

    def pretty_print(self) -> str:
        from radixserve.cache.core.radix_check import format_tree

        text = format_tree(self)
        print(text)
        return text

    # ---- internals --------------------------------------------------------------------------

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child``'s edge at ``split_len``: parent -> new -> child. Returns new.

        The new node inherits the child's lock count and statistics (it stands
        for the shared part of every request below it). Sizes do not change.
        """
        parent = child.parent
        assert parent is not None
        new = TreeNode(next(self._ids), child.key[:split_len], child.value[:split_len].copy(), parent, 0.0)
        new.key.token_ids = new.key.token_ids.copy()
        new.lock_ref, new.hit_count, new.priority = child.lock_ref, child.hit_count, child.priority
        new.last_access_time, new.creation_time = child.last_access_time, child.creation_time
        new.depth = child.depth
        # The upper part keeps the turns that ended on ``child`` when the cut is in its second half: a next turn
        # re-reads all but the last partial page of its predecessor, a sibling shares only a head (a system prompt).
        new.turn, new.ends = child.turn, child.ends if 2 * split_len >= len(child.key) else 0
        new.child_key = child.child_key  # the same first page
        parent.children[new.child_key] = new
        child.key = child.key[split_len:]
        child.key.token_ids = child.key.token_ids.copy()
        child.value = child.value[split_len:].copy()
        child.parent = new
        child.depth += split_len
        child.child_key = child.key.child_key(self.page_size)
        new.children[child.child_key] = child
        if child in self.candidates:  # it now starts deeper: a policy ranking by depth re-ranks it
            self.candidates.add(child)
        return new

    def _add_leaf(self, parent: TreeNode, key: RadixKey, value: IndexArray, priority: int, now: float) -> TreeNode:
        key.token_ids = key.token_ids.copy()  # never alias the caller's token buffer
        leaf = TreeNode(next(self._ids), key, value, parent, now)
        leaf.priority = priority
        leaf.child_key = key.child_key(self.page_size)
        parent.children[leaf.child_key] = leaf
        self._evictable_size += len(key)
        if len(parent.children) == 1 and not parent.lock_ref:  # the parent was an unlocked leaf: a candidate
            self.candidates.discard(parent)
        self.candidates.add(leaf)  # unlocked and childless
        return leaf

    def _delete_leaf(self, node: TreeNode) -> None:
        """Unlink a leaf the candidates just popped; its parent becomes a candidate if now an unlocked leaf."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0  # and no longer a candidate
        del parent.children[node.child_key]
        self._evictable_size -= len(node.key)
        if not parent.children and parent.lock_ref == 0 and parent is not self.root:
            self.candidates.add(parent)

    def _touch(self, node: TreeNode, now: float) -> None:
        node.last_access_time = now
        self.candidates.refresh(node)

    def _path_key_slots(self, node: TreeNode) -> tuple[RadixKey, IndexArray]:
        """The whole cached sequence ending at ``node`` (its namespace, shared head) and its slots."""
        values = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.root:
            values.append(cursor.value)
            cursor = cursor.parent
        return self.path_key(node), np.concatenate(values[::-1])


def _ghost_key(node: TreeNode) -> tuple[int, Hashable]:
    """Where ``node`` hangs: what ``match_prefix`` passes to ``note_miss`` when it stops there."""
    return (node.parent.id, node.child_key)  # type: ignore[union-attr]  # candidates are never the root


def _node_len(node: TreeNode) -> int:
    return len(node.value)  # an ndarray: no Python-level __len__ (RadixKey's) per call
