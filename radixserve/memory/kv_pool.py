"""The KV pool: per layer, K and V tensors of [num_kv_heads, num_slots, head_dim].

Slot i holds the K/V of whichever token the allocator handed it to; slot 0
(page 0) is padding. The pool knows nothing of requests: the model writes the
new tokens' K/V by slot index and reads a context by gathering its slots.

Heads first: gathering a context copies, per K/V head, contiguous head_dim rows
into the [heads, tokens, head_dim] blocks attention reads (measured on SmolLM2
at batch 32 decode: ~124 ms per step for gather + attention, vs ~200 ms with
slots first).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def hugepages_on_advice() -> bool:
    """Whether this kernel backs a region with transparent huge pages when it is madvised (THP mode
    ``always`` or ``madvise``; not ``never``, not outside Linux)."""
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return sys.platform.startswith("linux") and ("[always]" in mode or "[madvise]" in mode)


def huge_page_interior(addr: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [addr, addr + nbytes): (start, length), length 0 when there are none."""
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def zeros_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor [numel] on transparent huge pages where the kernel allows (else torch.zeros):
    decode attention streams every request's K/V once a layer, and with 4 KiB pages each 4 KiB is a TLB miss
    and a stop for the hardware prefetcher (a 2k-context, batch-16 step: 49 -> 44.5 ms). Only memory nothing
    has touched takes the advice, and malloc may hand out heap pages touched before, so the tensor lies in a
    mapping of its own (private, anonymous, starting on a 2 MiB boundary), advised MADV_HUGEPAGE and then
    zeroed, which faults it in. The tensor keeps the mapping alive."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * itemsize
    if not hugepages_on_advice() or nbytes < HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start, length = huge_page_interior(raw.data_ptr(), raw.numel())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), ctypes.c_int(MADV_HUGEPAGE))
    offset = start - raw.data_ptr()
    return raw[offset : offset + nbytes].view(dtype).zero_()


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_kv_heads, num_slots, head_dim)
        if self.device.type == "cpu":
            # One buffer for every layer's K and V, on huge pages where the kernel allows (see above).
            per = num_kv_heads * num_slots * head_dim
            parts = zeros_on_huge_pages(2 * num_layers * per, dtype).view(2 * num_layers, *shape).unbind(0)
            self.k, self.v = list(parts[:num_layers]), list(parts[num_layers:])
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token across all layers (SmolLM2 fp32: 30 x 3 x 64 x 2 x 4 B = 46 KiB)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, num_kv_heads, head_dim] of n tokens at ``slots`` [n]."""
        self.k[layer][:, slots] = k.transpose(0, 1).to(self.dtype)
        self.v[layer][:, slots] = v.transpose(0, 1).to(self.dtype)

    def write_rotated(
        self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> torch.Tensor:
        """The fused CPU path of attention's rotary + ``write``: qkv [n, (num_heads + 2 Hkv) * head_dim] (q | k | v
        of n tokens), cos/sin [n, 1, head_dim] in qkv's dtype. Rotates q and k, stores k and v at ``slots``
        [n] (int64) in one pass over the rows (csrc/fused_ops.cpp: the bits of apply_rotary + ``write``);
        returns q rotated, [n, num_heads, head_dim]. float32 or bfloat16 qkv and pool, on CPU."""
        q: torch.Tensor = torch.ops.radixserve.rotary_kv_write(
            qkv, cos, sin, slots, self.k[layer], self.v[layer], num_heads, self.k[layer].shape[0]
        )
        return q

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V [num_kv_heads, n, head_dim] of the tokens at ``slots`` [n] (a copy)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]
