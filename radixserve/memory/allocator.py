"""KV slot allocator: hands out indices into the KV pool, a page at a time.

Slot layout of a pool of ``size`` usable slots with page size P::

    slot  0 .. P-1          page 0: reserved (padding writes land here)
    slot  P .. size+P-1     pages 1 .. size/P: handed out and taken back

The KV pool tensors therefore have ``size + page_size`` rows. Free pages live
on a stack (a preallocated array plus a top pointer), so ``alloc`` and ``free``
cost O(pages moved), never O(pool size): no concatenation per free.

Ownership: a page is either on the free stack or owned by exactly one holder
(a live request's private tail, or the prefix cache). ``free`` of a page that is
not currently allocated raises, which catches double frees at the call site.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]


class AllocatorError(ValueError):
    """A free of slots that are not currently allocated (double free or stray)."""


class TokenAllocator:
    """A pool of ``size`` KV slots handed out in whole pages of ``page_size``."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        # One flag per page including reserved page 0 (never free, never allocatable).
        self._page_free = np.zeros(self.num_pages + 1, dtype=bool)
        self._stack = np.empty(self.num_pages, dtype=np.int64)
        self._mark = np.empty(self.num_pages + 1, dtype=np.int64)  # scratch for free's repeat check
        self.reset()

    def reset(self) -> None:
        """Return every slot to the pool (only valid when nothing holds slots)."""
        # Descending on the stack so the lowest pages are handed out first.
        self._stack[:] = np.arange(self.num_pages, 0, -1, dtype=np.int64)
        self._top = self.num_pages
        self._page_free[1:] = True

    def free_size(self) -> int:
        """Number of slots that ``alloc`` can still hand out."""
        return self._top * self.page_size

    def alloc(self, num_tokens: int) -> IndexArray | None:
        """Slots for ``num_tokens`` tokens, or None when the pool is short (never partial).

        With page_size > 1 whole pages are taken: the caller owns the unused
        slots at the end of the last page and fills them (decode) before
        asking for another page.
        """
        if num_tokens < 0:
            raise ValueError(f"cannot allocate {num_tokens} slots")
        num_pages = -(-num_tokens // self.page_size)
        if num_pages > self._top:
            return None
        pages = self._stack[self._top - num_pages : self._top][::-1].copy()
        self._top -= num_pages
        self._page_free[pages] = False
        if self.page_size == 1:
            return pages
        slots = (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)
        return slots[:num_tokens]

    def free(self, indices: IndexArray) -> None:
        """Give back the pages holding ``indices``; raises if any is not allocated.

        Nothing changes when it raises. No sort on the hot path: a page's slots
        arrive as one run, and a scatter of positions catches any repeat.
        """
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) == 0:
            return
        pages = indices
        if self.page_size > 1:
            pages = indices // self.page_size
            pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
        if pages.min() < 1 or pages.max() > self.num_pages:
            raise AllocatorError(f"free of slots outside the pool: pages {pages.min()}..{pages.max()}")
        if len(pages) > 1:
            order = np.arange(len(pages))
            self._mark[pages] = order
            if not np.array_equal(self._mark[pages], order):
                if self.page_size == 1:
                    raise AllocatorError("double free: the same slot appears twice in one free")
                pages = np.unique(pages)  # one page's slots were not contiguous
        if self._page_free[pages].any():
            bad = pages[self._page_free[pages]][:8].tolist()
            raise AllocatorError(f"double free or free of slots never handed out (pages {bad})")
        self._page_free[pages] = True
        self._stack[self._top : self._top + len(pages)] = pages[::-1]  # next alloc: ascending
        self._top += len(pages)

    def is_free(self, indices: IndexArray) -> npt.NDArray[np.bool_]:
        """Per slot: True if it is on the free stack (for invariant checks)."""
        return self._page_free[np.asarray(indices, dtype=np.int64) // self.page_size]

    def free_slots(self) -> IndexArray:
        """Every free slot, in no particular order (for invariant checks; O(pool))."""
        pages = self._stack[: self._top]
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)
