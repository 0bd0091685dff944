"""Miniature simulations (Waldspurger et al., ATC '17): each fixed policy replayed on a spatial sample of blocks.

A request's tokens fall in blocks of ``block_tokens``; a block is named by a hash of its whole prefix (a
polynomial over each block's last token, mod 2**64, in its namespace), so two requests name a block alike when
they share that prefix, as the tree's nodes do. A block is in the sample when its mixed name falls below
``rate``: the same blocks every time, whoever reads them (spatial sampling), so a sampled block sees every one
of its reuses, and a shadow cache of ``rate`` x the tree's capacity over the sampled blocks sees about the hit
rate the whole cache would have under its policy. One vectorised pass per key (a cumulative sum over one token
per block); only the sampled blocks cost Python work.

A shadow holds sampled blocks, no tree: in the tree a parent is read whenever a child is, so its rank under
LRU, SLRU or LFU is never below its children's, and ranking the blocks alone keeps the tree's order (a child
first) without the tree. What a shadow does not model: locked in-flight requests (the live pool holds less
than its capacity while they run) and partial blocks (a tail under ``block_tokens``).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

from radixserve.cache.core.key import RadixKey

_MIX = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 (Fibonacci hashing) as int64: spreads small names
_BASE = 0xC2B2AE3D27D4EB4F  # the polynomial's base (odd: every power is a unit mod 2**64)


class BlockSampler:
    """Names and samples a key's whole blocks: ``sampled(key)`` -> the names of those sampled, shallowest first."""

    def __init__(self, block_tokens: int, rate: float) -> None:
        self.block_tokens, self.rate = block_tokens, rate
        self._threshold = np.uint64(min(int(rate * (1 << 64)), 1 << 64) - 1)  # rate 1: every block
        self._powers = np.ones(0, dtype=np.int64)

    def sampled(self, key: RadixKey) -> list[int]:
        blocks = len(key) // self.block_tokens
        if blocks == 0:
            return []
        # A block is read by its last token (a strided view: no pass over every token); its name is a polynomial
        # hash of every read up to it (mod 2**64), plus its namespace's tag. Two prefixes that differ only inside
        # blocks share a name, and a shadow then counts one hit too many: rare with real token ids.
        reads = key.token_ids[self.block_tokens - 1 : blocks * self.block_tokens : self.block_tokens]
        names = np.cumsum(reads * self._power_table(blocks)[:blocks])
        if key.extra_key is not None:
            names += _namespace(key.extra_key)
        picked = np.flatnonzero((names * _MIX).view(np.uint64) <= self._threshold)  # on the mixed name's high bits
        sampled: list[int] = names[picked].tolist()
        return sampled

    def _power_table(self, length: int) -> npt.NDArray[np.int64]:
        if len(self._powers) < length:
            size = max(length, 2 * len(self._powers), 256)
            powers = np.empty(size, dtype=np.int64)
            value = 1
            for i in range(size):  # once per doubling; Python ints: exact mod 2**64, stored as int64's bits
                powers[i] = value - (1 << 64) if value >= 1 << 63 else value
                value = value * _BASE % (1 << 64)
            self._powers = powers
        return self._powers


def _namespace(extra_key: str) -> int:
    return zlib.crc32(extra_key.encode()) << 31


class ShadowCache:
    """One fixed policy over the sampled blocks, at most ``capacity`` of them; ``hit_tokens`` counts its hits.

    ``lookup(names)`` counts the blocks present as hits and refreshes them (``match_prefix``); ``insert(names)``
    gives those present one more reuse and adds the rest, then the lowest ranked go past capacity (a finished
    request's ``insert``). A request's blocks go deepest first, so within one request the shallowest is the most
    recent (the tree evicts a child leaf before its parent). Each subclass keeps its policy's order in ordered
    dicts (O(1) per block): the ranks of policy.py's LRU, SLRU and LFU, ties by age (test_minisim.py holds each
    to the strategy's own rank).
    """

    def __init__(self, capacity: int, block_tokens: int) -> None:
        self.capacity, self.block_tokens = max(capacity, 1), block_tokens
        self.hit_tokens = 0.0
        self.size = 0

    def lookup(self, names: list[int]) -> None:
        """A request's sampled blocks looked up: those present are hits (``hit_tokens``), refreshed."""
        raise NotImplementedError

    def insert(self, names: list[int]) -> None:
        """A finished request's sampled blocks: those present get one more reuse (refreshed), the rest are
        added; then the lowest ranked go past capacity."""
        raise NotImplementedError

    def order(self) -> list[int]:
        """Every block, the next to be evicted first (for the tests)."""
        raise NotImplementedError


class LRUShadow(ShadowCache):
    def __init__(self, capacity: int, block_tokens: int) -> None:
        super().__init__(capacity, block_tokens)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def lookup(self, names: list[int]) -> None:
        blocks, hits = self._blocks, 0
        for name in reversed(names):
            if name in blocks:
                blocks.move_to_end(name)
                hits += 1
        self.hit_tokens += hits * self.block_tokens

    def insert(self, names: list[int]) -> None:
        blocks = self._blocks
        for name in reversed(names):
            if name in blocks:
                blocks.move_to_end(name)
            else:
                blocks[name] = None
                self.size += 1
        while self.size > self.capacity:
            blocks.popitem(last=False)
            self.size -= 1

    def order(self) -> list[int]:
        return list(self._blocks)


class SLRUShadow(ShadowCache):
    """Blocks reused at least once (``SLRUStrategy.PROTECT_HITS``) go after every probationary one."""

    def __init__(self, capacity: int, block_tokens: int) -> None:
        super().__init__(capacity, block_tokens)
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    def lookup(self, names: list[int]) -> None:
        probation, protected, hits = self._probation, self._protected, 0
        for name in reversed(names):
            if name in protected:
                protected.move_to_end(name)
            elif name in probation:
                probation.move_to_end(name)
            else:
                continue
            hits += 1
        self.hit_tokens += hits * self.block_tokens

    def insert(self, names: list[int]) -> None:
        probation, protected = self._probation, self._protected
        for name in reversed(names):
            if name in protected:
                protected.move_to_end(name)
            elif name in probation:
                del probation[name]
                protected[name] = None
            else:
                probation[name] = None
                self.size += 1
        while self.size > self.capacity:
            (probation or protected).popitem(last=False)
            self.size -= 1

    def order(self) -> list[int]:
        return [*self._probation, *self._protected]


class LFUShadow(ShadowCache):
    """Fewest reuses first, least recent among equals: one ordered dict per reuse count (O(1) LFU)."""

    def __init__(self, capacity: int, block_tokens: int) -> None:
        super().__init__(capacity, block_tokens)
        self._reuses: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._least = 0  # no block has fewer reuses

    def lookup(self, names: list[int]) -> None:
        reuses, buckets, hits = self._reuses, self._buckets, 0
        for name in reversed(names):
            count = reuses.get(name)
            if count is not None:
                buckets[count].move_to_end(name)
                hits += 1
        self.hit_tokens += hits * self.block_tokens

    def insert(self, names: list[int]) -> None:
        reuses, buckets = self._reuses, self._buckets
        for name in reversed(names):
            count = reuses.get(name)
            if count is None:
                reuses[name] = 0
                buckets.setdefault(0, OrderedDict())[name] = None
                self._least = 0
                self.size += 1
                continue
            bucket = buckets[count]
            del bucket[name]
            if not bucket:
                del buckets[count]
            reuses[name] = count + 1
            buckets.setdefault(count + 1, OrderedDict())[name] = None
        while self.size > self.capacity:
            self._evict()

    def _evict(self) -> None:
        while self._least not in self._buckets:  # counts only grow, new blocks reset it: amortised O(1)
            self._least += 1
        bucket = self._buckets[self._least]
        name, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[self._least]
        del self._reuses[name]
        self.size -= 1

    def order(self) -> list[int]:
        return [name for count in sorted(self._buckets) for name in self._buckets[count]]


SHADOWS: dict[str, type[ShadowCache]] = {"lru": LRUShadow, "slru": SLRUShadow, "lfu": LFUShadow}
