"""Whole pages of K/V copied between the KV pool and the lower tiers (host, disk).

A tier page holds ``page_tokens`` consecutive tokens of one cached sequence, for
every layer: a tensor ``[num_layers, 2 (K, V), num_kv_heads, page_tokens, row]``
in the pool's dtype, as the pool stores it (``KVPool.gather_rows``): row = head_dim values, and
for the 8-bit pools their codes followed by their bfloat16 scale's two bytes (head_dim + 2), so
the host and disk tiers hold 8-bit pages as they are. On disk it is those bytes, raw: the
directory's fingerprint (``PageLayout.describe``: the dtype and the row among it) says how to read
them back, and a directory written with another KV dtype is not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.memory.allocator import IndexArray
from radixserve.memory.kv_pool import KVPool


@dataclass(frozen=True)
class PageLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype
    scale_bytes: int = 0  # appended to each row: the 8-bit pool's bfloat16 scale

    @classmethod
    def of_pool(cls, pool: KVPool, page_tokens: int) -> PageLayout:
        heads, _, head_dim = pool.k[0].shape
        scale_bytes = pool.k_scale[0].element_size() if pool.quantized else 0
        return cls(len(pool.k), heads, head_dim, page_tokens, pool.dtype, scale_bytes)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.page_tokens, self.head_dim + self.scale_bytes)

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()

    def describe(self) -> dict[str, object]:
        """The KV layout part of a cache directory's fingerprint."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_tokens": self.page_tokens,
            "dtype": str(self.dtype).removeprefix("torch."),
            **({"scale": "bfloat16 per token and head"} if self.scale_bytes else {}),
        }

    def to_bytes(self, page: torch.Tensor) -> bytes:
        return page.contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def from_bytes(self, data: bytes) -> torch.Tensor:
        """The page in ``data`` (a copy); ValueError if the size is not one page."""
        if len(data) != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {len(data)}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.shape)


def gather_page(pool: KVPool, slots: IndexArray) -> torch.Tensor:
    """A host copy of the K/V at ``slots`` (one tier page): [layers, 2, heads, tokens, head_dim]."""
    return pool.gather_rows(torch.as_tensor(slots, dtype=torch.long, device=pool.device)).cpu()


def scatter_tokens(pool: KVPool, slots: IndexArray, page: torch.Tensor, first: int) -> None:
    """Write tokens ``first..first+len(slots)`` of ``page`` into the pool at ``slots``."""
    index = torch.as_tensor(slots, dtype=torch.long, device=pool.device)
    pool.scatter_rows(index, page[:, :, :, first : first + len(slots)])


class PoolPageMover:
    """Tier pages of one KV pool: what the cache's tier index moves between tiers."""

    def __init__(self, pool: KVPool, page_tokens: int) -> None:
        self.pool = pool
        self.layout = PageLayout.of_pool(pool, page_tokens)

    def gather(self, slots: IndexArray) -> torch.Tensor:
        return gather_page(self.pool, slots)

    def split_pages(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Tier pages (views) of what ``gather`` returned for consecutive whole pages of slots."""
        return torch.split(rows, self.layout.page_tokens, dim=3)

    def scatter_pages(self, slots: IndexArray, pages: Sequence[torch.Tensor], first: int) -> None:
        """Consecutive pages into ``slots``, from token ``first`` of the first page: one copy per layer."""
        whole = pages[0] if len(pages) == 1 else torch.cat(list(pages), dim=3)
        scatter_tokens(self.pool, slots, whole, first)

    def to_bytes(self, page: torch.Tensor) -> bytes:
        return self.layout.to_bytes(page)

    def from_bytes(self, data: bytes) -> torch.Tensor:
        return self.layout.from_bytes(data)


def tier_page_tokens(page_size: int, minimum: int = 16) -> int:
    """The tier page: the smallest multiple of the cache page that holds ``minimum`` tokens."""
    return page_size * -(-minimum // page_size)
