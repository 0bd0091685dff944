"""The KV pool: per layer, K and V tensors of [num_kv_heads, num_slots, head_dim].

The 8-bit pools (``--kv-cache-dtype int8``: dtype torch.int8; ``fp8_e4m3``: torch.float8_e4m3fn) store per layer
K and V as 8-bit codes [num_kv_heads, num_slots, head_dim] plus their scales as bfloat16 [num_kv_heads,
num_slots]: one symmetric absmax scale per token and head (scale = max|x| / 127 of that row for int8, / 448 for
fp8_e4m3: kv_quant.py), so x ~ code * scale. 66 bytes a head row against bfloat16's 128 at head_dim 64: 1.94x
the tokens per GiB. Writing a token quantizes it; the CPU kernels read an int8 pool's codes and scales in place
(folding the scale into the score and the softmax weight), the reference path (CUDA's) dequantizes what it
gathers.

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

from radixserve.memory.kv_quant import CODE_MAX, dequantize, quantize_absmax

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


# The 8-bit pools' scales: bfloat16 (2 bytes a row; float32 would leave 1.88x, not 1.9x, of bfloat16's tokens).
SCALE_DTYPE = torch.bfloat16
EIGHT_BIT_DTYPES = tuple(CODE_MAX)  # pools of 8-bit codes and scales: int8, float8_e4m3fn


def kv_row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) row of one head: the values, and an 8-bit pool's scale."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return head_dim * itemsize + (SCALE_DTYPE.itemsize if dtype in EIGHT_BIT_DTYPES else 0)


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
        self.quantized = dtype in EIGHT_BIT_DTYPES
        self.k, self.v = self._layers(num_layers, (num_kv_heads, num_slots, head_dim), dtype)
        self.k_scale: list[torch.Tensor] = []  # the 8-bit pool's scales, per layer [num_kv_heads, num_slots]
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            self.k_scale, self.v_scale = self._layers(num_layers, (num_kv_heads, num_slots), SCALE_DTYPE)

    def _layers(
        self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed K and V tensors of ``shape`` per layer; on CPU one buffer for all, on huge pages where the kernel
        allows (see above)."""
        if self.device.type == "cpu":
            per = int(torch.Size(shape).numel())
            parts = zeros_on_huge_pages(2 * num_layers * per, dtype).view(2 * num_layers, *shape).unbind(0)
            return list(parts[:num_layers]), list(parts[num_layers:])
        make = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2 * num_layers)]
        return make[:num_layers], make[num_layers:]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token across all layers, an 8-bit pool's scales included (SmolLM2 fp32: 30 x 3 x 64 x 2
        x 4 B = 46 KiB; int8: 30 x 3 x (64 + 2) x 2 B = 11.6 KiB)."""
        return 2 * num_layers * num_kv_heads * kv_row_bytes(head_dim, dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, num_kv_heads, head_dim] of n tokens at ``slots`` [n] (an 8-bit pool quantizes each
        token-head row with its own scale)."""
        if not self.quantized:
            self.k[layer][:, slots] = k.transpose(0, 1).to(self.dtype)
            self.v[layer][:, slots] = v.transpose(0, 1).to(self.dtype)
            return
        for x, codes, scales in ((k, self.k[layer], self.k_scale[layer]), (v, self.v[layer], self.v_scale[layer])):
            q, scale = quantize_absmax(x.transpose(0, 1), -1, SCALE_DTYPE, self.dtype)
            codes.view(torch.uint8)[:, slots] = q.view(torch.uint8)  # as bytes: fp8 indexing is patchy by device
            scales[:, slots] = scale[..., 0]

    def dequantized(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of an 8-bit pool at ``slots`` [..., S] as [Hkv, ..., S, D] in ``dtype`` (a copy: the reference
        path's gather)."""
        k, v = (codes.view(torch.uint8)[:, slots].view(self.dtype) for codes in (self.k[layer], self.v[layer]))
        return (
            dequantize(k, self.k_scale[layer][:, slots][..., None], dtype),
            dequantize(v, self.v_scale[layer][:, slots][..., None], dtype),
        )

    def gather_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V rows at ``slots`` [n] as stored: [layers, 2, Hkv, n, row] (row: head_dim values;
        an 8-bit pool's are its codes with the bfloat16 scale's 2 bytes appended, in the codes' dtype). What the
        tiers move."""
        rows = [torch.stack((self._raw(k, ks, slots), self._raw(v, vs, slots))) for k, v, ks, vs in self._all()]
        return torch.stack(rows)

    def scatter_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of ``gather_rows``: rows [layers, 2, Hkv, n, row] into ``slots`` [n]."""
        head_dim = self.k[0].shape[2]
        for layer, (k, v, ks, vs) in enumerate(self._all()):
            for kind, (values, scales) in enumerate(((k, ks), (v, vs))):
                part = rows[layer, kind].to(values.device)
                if scales is None:
                    values[:, slots] = part.to(values.dtype)
                    continue
                values.view(torch.uint8)[:, slots] = part[..., :head_dim].view(torch.uint8)
                scales[:, slots] = part[..., head_dim:].contiguous().view(SCALE_DTYPE)[..., 0]

    def _all(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per layer (K, V, K's scales, V's scales); the scales None for a float pool."""
        if self.quantized:
            return list(zip(self.k, self.v, self.k_scale, self.v_scale))
        return [(k, v, None, None) for k, v in zip(self.k, self.v)]

    @staticmethod
    def _raw(values: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        if scales is None:
            return values[:, slots]
        scale_bytes = scales[:, slots].contiguous().view(torch.uint8)  # [Hkv, 2n]: each bfloat16's two bytes
        codes = values.view(torch.uint8)[:, slots]  # 8-bit codes as bytes: fp8 indexing is patchy by device
        return torch.cat((codes, scale_bytes.view(*scale_bytes.shape[:-1], -1, 2)), -1).view(values.dtype)

    def write_rotated(
        self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> torch.Tensor:
        """The fused CPU path of attention's rotary + ``write``: qkv [n, (num_heads + 2 Hkv) * head_dim] (q | k | v
        of n tokens), cos/sin [n, 1, head_dim] in qkv's dtype. Rotates q and k, stores k and v at ``slots``
        [n] (int64) in one pass over the rows (csrc/fused_ops.cpp: the bits of apply_rotary + ``write``);
        returns q rotated, [n, num_heads, head_dim]. float32 or bfloat16 qkv, a float32, bfloat16 or int8 pool (its
        rows quantized as ``write`` quantizes them), on CPU."""
        scales = (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)
        k = self.k[layer]
        q: torch.Tensor = torch.ops.radixserve.rotary_kv_write.default(  # the overload: ~0.9 us less a call
            qkv, cos, sin, slots, k, self.v[layer], num_heads, k.shape[0], *scales
        )
        return q

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V [num_kv_heads, n, head_dim] of the tokens at ``slots`` [n] (a copy)."""
        return self.k[layer][:, slots], self.v[layer][:, slots]
