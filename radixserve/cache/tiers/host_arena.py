"""HostArena: the L2 tier, tier pages in host RAM bounded by a byte capacity.

Pages are keyed by their chained page hash (which folds in the namespace, so two
tenants' pages never share an entry) and evicted least recently used first; an
evicted page is handed back to the caller, which spills it to the disk tier.

``compress=True`` stores K/V as int8 with one fp32 scale per (layer, K/V, head)
of each page: about 4x the tokens per GiB of fp32 pages, but lossy (loaded K/V
differ by up to scale/2). Off by default: a hit must reproduce the cold output
exactly. Pages of the 8-bit pools (int8 or fp8 codes with their scales) are stored as
they are, compressed or not: they are 8 bits already. On CUDA the lossless pages sit in
pinned memory (fast copies back).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

import torch

from radixserve.memory.kv_quant import dequantize, quantize_absmax


class _Stored(NamedTuple):
    data: torch.Tensor  # the page, or its int8 codes when compressed
    scale: torch.Tensor | None  # [layers, 2, heads, 1, 1] fp32, when compressed
    dtype: torch.dtype  # the page's own dtype (what ``get`` returns)
    nbytes: int


class HostArena:
    def __init__(self, capacity_bytes: int, compress: bool = False, pin: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.compress = compress
        self.pin = pin and torch.cuda.is_available()
        self._pages: OrderedDict[bytes, _Stored] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def hashes(self) -> Iterator[bytes]:
        return iter(list(self._pages))

    def get(self, page_hash: bytes) -> torch.Tensor | None:
        """The page (dequantized when compressed), now most recently used; None if absent."""
        stored = self._pages.get(page_hash)
        if stored is None:
            return None
        self._pages.move_to_end(page_hash)
        if stored.scale is None:
            return stored.data
        return dequantize(stored.data, stored.scale, stored.dtype)

    def put(self, page_hash: bytes, page: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Store ``page`` (copied); return the pages evicted to make room, oldest first.

        A page larger than the whole arena is not stored (it comes back as evicted).
        """
        if page_hash in self._pages:
            self._pages.move_to_end(page_hash)
            return []
        stored = self._encode(page)
        if stored.nbytes > self.capacity_bytes:
            return [(page_hash, page)]
        evicted = []
        while self.used_bytes + stored.nbytes > self.capacity_bytes:
            old_hash = next(iter(self._pages))
            page_out = self.get(old_hash)
            assert page_out is not None
            self.discard(old_hash)
            evicted.append((old_hash, page_out))
        self._pages[page_hash] = stored
        self.used_bytes += stored.nbytes
        return evicted

    def discard(self, page_hash: bytes) -> None:
        stored = self._pages.pop(page_hash, None)
        if stored is not None:
            self.used_bytes -= stored.nbytes

    def clear(self) -> None:
        self._pages.clear()
        self.used_bytes = 0

    def check(self) -> None:
        """Host bytes are conserved: the counter equals what the pages hold and fits the capacity."""
        total = sum(stored.nbytes for stored in self._pages.values())
        assert total == self.used_bytes, f"host arena counts {self.used_bytes} bytes, holds {total}"
        assert self.used_bytes <= self.capacity_bytes, "host arena over capacity"

    def _encode(self, page: torch.Tensor) -> _Stored:
        if not self.compress or page.element_size() == 1:  # 8-bit pages (int8, fp8 codes) stay as they are
            data = page.detach().to("cpu", copy=True).contiguous()
            if self.pin:
                data = data.pin_memory()
            return _Stored(data, None, page.dtype, data.numel() * data.element_size())
        codes, scale = quantize_absmax(page.detach().to("cpu"), dim=(3, 4))
        return _Stored(codes, scale, page.dtype, codes.numel() + scale.numel() * 4)
