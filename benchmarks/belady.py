"""The offline optimal bound: a radix cache that evicts the token used furthest in the future.

Belady's MIN evicts, of everything evictable, the item whose next use lies
furthest ahead; for unit-size items it minimises misses, so no online policy
beats its hit count. Here an item is a token *position*: a prefix of some
sequence. A request uses position ``d`` of its prompt only if it also uses
every position before it, so a deeper token's next use is never earlier than
its parent's, and evicting furthest-next-use-first takes leaves' tails first:
the cache stays a tree (prefix-closed), exactly like the online caches.

``FutureIndex`` knows, for any prefix, which requests' prompts start with it (a
compressed trie of every prompt, each node listing its users in trace order).
``BeladyCache`` is the project's RadixCache with a strategy that ranks a leaf
by the next use of its last token and, through the strategy's ``evict_len``
(the tree's supported extension point), frees exactly the number of tokens
asked, trimming a leaf's tail where the online caches free whole leaves:
token-level MIN. The replay (``simulate.replay``) advances the
cache's clock to the index of the request being served.

``ORACLES`` adds two weaker ones that know *whether* a leaf is read again but
not *when* (``EverStrategy``, ``EverLeafStrategy``): how much of Belady's gap
a perfect predictor of reuse would close (issue 36).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from radixserve.cache.core.key import TokenArray, common_prefix_len
from radixserve.cache.core.policy import EvictionStrategy, NodeStats, Rank
from radixserve.cache.core.radix import Clock, RadixCache, TreeNode
from radixserve.memory.allocator import TokenAllocator

NEVER = math.inf


class _Node:
    __slots__ = ("edge", "children", "users")

    def __init__(self, edge: TokenArray, users: list[int]) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.users: list[int] | np.ndarray = users  # request indices whose prompt passes this node's end


class FutureIndex:
    """Which requests' prompts start with a given prefix, per namespace.

    Every prompt end and every divergence is a node boundary, so all positions
    inside one node's edge have the same users.
    """

    def __init__(self, prompts: Sequence[tuple[str | None, TokenArray]]) -> None:
        self._roots: dict[str | None, _Node] = {}
        for index, (namespace, prompt) in enumerate(prompts):
            self._insert(namespace, np.asarray(prompt, dtype=np.int64), index)
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                node.users = np.asarray(node.users, dtype=np.int64)
                stack.extend(node.children.values())

    def _insert(self, namespace: str | None, prompt: TokenArray, index: int) -> None:
        node = self._roots.setdefault(namespace, _Node(prompt[:0], []))
        pos = 0
        while pos < len(prompt):
            head = int(prompt[pos])
            child = node.children.get(head)
            if child is None:
                node.children[head] = _Node(prompt[pos:], [index])
                return
            matched = common_prefix_len(child.edge, prompt[pos:])
            if matched < len(child.edge):  # diverges or ends inside the edge: split there
                upper = _Node(child.edge[:matched], list(child.users))
                child.edge = child.edge[matched:]
                upper.children[int(child.edge[0])] = child
                node.children[head] = child = upper
            assert isinstance(child.users, list)
            child.users.append(index)
            node, pos = child, pos + matched

    def next_use(self, namespace: str | None, path: TokenArray, now: int) -> tuple[float, int]:
        """(the first request after ``now`` whose prompt starts with ``path``, or inf; the depth
        from which ``path``'s tail shares that next use: evicting from there back loses nothing else)."""
        node = self._roots.get(namespace)
        if node is None:
            return NEVER, 0
        pos = start = 0
        while pos < len(path):
            child = node.children.get(int(path[pos]))
            if child is None:
                return NEVER, pos
            matched = common_prefix_len(child.edge, path[pos:])
            if matched < min(len(child.edge), len(path) - pos):
                return NEVER, pos + matched  # no prompt goes on past here
            node, start, pos = child, pos, pos + matched
        users = np.asarray(node.users)
        i = int(np.searchsorted(users, now, side="right"))
        return (float(users[i]) if i < len(users) else NEVER), start


class BeladyStrategy(EvictionStrategy):
    """Rank = minus the next use of the leaf's last token: furthest (or never) first. Frees a leaf's
    tail only where the tail alone is used no sooner (``evict_len``): token-level MIN."""

    rank_only_grows = False  # as time passes a node's next use moves later: more evictable

    def __init__(self, index: FutureIndex) -> None:
        self.index = index
        self.cache: BeladyCache | None = None

    def rank(self, node: NodeStats) -> Rank:
        assert self.cache is not None and isinstance(node, TreeNode)
        next_use, _ = self.cache.next_use(node)
        return (-next_use,)

    def evict_len(self, node: Any, node_len: int, wanted: int) -> int:
        """Exactly what is still ``wanted``, from the leaf's tail back to where its next use is shared."""
        assert self.cache is not None and isinstance(node, TreeNode)
        _, tail_start = self.cache.next_use(node)
        end = node.depth + node_len  # tokens from the root to the leaf's end
        return min(end - max(tail_start, end - node_len), wanted)


class EverStrategy(BeladyStrategy):
    """An oracle that knows *whether* a leaf is read again but not *when*: the leaves whose end no later
    request reads go first, and of those only the dead tail, back to where a later prompt still reads; then
    whole leaves, least recently used, as the online policies free them. What a perfect predictor of reuse
    would add to LRU's recency order (``--policies oracle-ever``; issue 36)."""

    def rank(self, node: NodeStats) -> Rank:
        assert self.cache is not None and isinstance(node, TreeNode)
        next_use, _ = self.cache.next_use(node)
        return (next_use != NEVER, node.last_access_time)

    def evict_len(self, node: Any, node_len: int, wanted: int) -> int:
        assert self.cache is not None and isinstance(node, TreeNode)
        next_use, tail_start = self.cache.next_use(node)
        if next_use != NEVER:
            return node_len
        end = node.depth + node_len
        return end - max(tail_start, end - node_len)


class EverLeafStrategy(EverStrategy):
    """``EverStrategy`` freeing dead leaves whole too: a leaf whose last token no one reads goes with its head,
    even where the next turn reads that head (a Mooncake prompt's partial last block is such a tail: it hashes
    anew once the next turn fills it)."""

    def evict_len(self, node: Any, node_len: int, wanted: int) -> int:
        return node_len


# Caches that read the future index (bench simulate --caches, bench policy-table --policies).
ORACLES = {"belady": BeladyStrategy, "oracle-ever": EverStrategy, "oracle-ever-leaf": EverLeafStrategy}


class BeladyCache(RadixCache):
    """RadixCache (page size 1) evicting by Belady's MIN over token positions (or another of ``ORACLES``);
    see the module doc.

    ``clock`` must return the index of the request being served.
    """

    def __init__(
        self, allocator: TokenAllocator, index: FutureIndex, clock: Clock, oracle: type[BeladyStrategy] = BeladyStrategy
    ) -> None:
        strategy = oracle(index)
        super().__init__(allocator, 1, strategy, clock)
        strategy.cache = self
        self.index = index

    def next_use(self, node: TreeNode) -> tuple[float, int]:
        return self.index.next_use(node.key.extra_key, self.path_key(node).token_ids, int(self.clock()))
