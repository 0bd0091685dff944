"""Tiered caches for ``bench simulate``: a RadixCache whose evictions go to an L2 and an L3, without K/V.

``tiered-<policy>-p<page>`` is the radix cache of that policy and page over an
L1 of the simulated capacity, with an L2 host tier of twice that (in tokens)
and an unbounded L3 (SGLang's HiCache shape: device -> host -> storage). Pages
carry one byte per token, so the tiers' capacities count tokens; the disk tier
is an in-memory stand-in with the disk store's interface (no files, no thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixserve.cache import RadixCache
from radixserve.cache.tiers.disk_store import DiskStats
from radixserve.cache.tiers.host_arena import HostArena
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import tier_page_tokens
from radixserve.memory import IndexArray, TokenAllocator


class TokenMover:
    """Pages of one byte per token: the tiers count tokens, nothing is copied."""

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens

    def gather(self, slots: IndexArray) -> torch.Tensor:
        return torch.zeros(len(slots), dtype=torch.uint8)

    def split_pages(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(rows, self.page_tokens)

    def scatter_pages(self, slots: IndexArray, pages: Sequence[torch.Tensor], first: int) -> None:
        pass

    def to_bytes(self, page: torch.Tensor) -> bytes:
        return bytes(len(page))

    def from_bytes(self, data: bytes) -> torch.Tensor:
        return torch.zeros(len(data), dtype=torch.uint8)


class MemoryPageStore:
    """The disk store's interface over a dict: an unbounded L3 for simulations."""

    def __init__(self) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.enabled = self.writable = True
        self.capacity_bytes = 1 << 62
        self.stats = DiskStats()
        self.on_drop: Callable[[bytes], None] | None = None  # never called: nothing leaves an unbounded store

    @property
    def used_bytes(self) -> int:
        return sum(map(len, self.pages.values()))

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def put(self, page_hash: bytes, payload: bytes, label: bytes = b"") -> bool:
        """The page's label is dropped: a simulation publishes no KV events, so nothing reads it back."""
        fresh = page_hash not in self.pages
        self.pages[page_hash] = payload
        return fresh

    def get(self, page_hash: bytes) -> bytes | None:
        return self.pages.get(page_hash)

    def labels(self) -> list[tuple[bytes, bytes]]:
        return [(page_hash, b"") for page_hash in self.pages]  # labels are not kept (see ``put``)

    def drop_corrupt(self, page_hash: bytes) -> None:
        del self.pages[page_hash]

    def state(self, page_hash: bytes) -> str:
        return "on_disk" if page_hash in self.pages else "absent"

    def clear(self) -> int:
        dropped = len(self.pages)
        self.pages.clear()
        return dropped

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float = 0.0) -> None:
        pass


def make_tiered_cache(policy: str, page_size: int, capacity: int, clock: Callable[[], float]) -> RadixCache:
    """L1 = ``capacity`` tokens, L2 = 2x, L3 unbounded; write-back, as SGLang's default."""
    size = capacity - capacity % page_size
    page_tokens = tier_page_tokens(page_size)
    disk = MemoryPageStore()
    tiers = TierIndex(TokenMover(page_tokens), page_tokens, HostArena(2 * size), disk)
    return RadixCache(TokenAllocator(size, page_size), page_size, policy, clock, tiers=tiers)
