"""Storing into the lower tiers: pages leaving the KV pool (L1) go to the host arena (L2), then to disk (L3).

A page leaving L1 is *demoted*: its K/V is copied, under its chained page hash,
into the host arena (L2), whose LRU victims spill to the disk store (L3).

Write policies (SGLang's names): ``write_back`` copies a page down only when
L1 evicts it (and to disk when L2 evicts it, or at shutdown); ``write_through``
copies every page to L2 and L3 as soon as the tree caches it, so a crash loses
nothing that reached the disk queue.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.cache.core.key import RadixKey
from radixserve.cache.events import PageLabel
from radixserve.cache.tiers.labels import encode_label
from radixserve.cache.tiers.pages import TierPages
from radixserve.memory.allocator import IndexArray


class TierStore(TierPages):
    """The tiers as the cache's listener (core/listener.py): ``slots`` must cover the whole path (the radix tree's)."""

    def on_insert(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """The tree just cached ``key[start:]`` at ``slots[start:]``: write-through copies it down."""
        if self.write_policy == "write_through":
            self._store(key, slots, start, host=True, disk=True)

    def on_evict(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """L1 is about to free ``key[start:]`` (``slots``: the whole path's): keep its pages below.

        Into L2 even when the disk has a copy: a page that came back from disk and
        was evicted again is hot, and L2 is the faster tier.
        """
        self._store(key, slots, start, host=True, disk=self.host is None)

    def on_clear(self) -> None:
        """The pool's cache was reset: L2 and L3 keep their pages (``clear_host`` and ``clear_disk`` drop them)."""

    def flush_path(self, key: RadixKey, slots: IndexArray) -> None:
        """Shutdown: make sure every whole page of a cached path is on disk (or queued)."""
        self._store(key, slots, 0, host=False, disk=True)

    def flush_host(self) -> None:
        """Shutdown: queue every L2 page the disk lacks."""
        if self.disk is None or self.host is None:
            return
        with self.lock:
            for page_hash in self.host.hashes():
                page = self.host.get(page_hash)
                if page is not None and page_hash not in self.disk:
                    self._to_disk(page_hash, page, self._labels.get(page_hash))

    def clear_host(self) -> int:
        """Drop L2; the pages dropped. A prefetch still running may add pages back (valid ones): a flush goes
        through ``TierIndex.clear``, which waits for it first."""
        with self.lock:
            hashes = list(self.host.hashes()) if self.host is not None else []
            for page_hash in hashes:
                self._dropped(page_hash, "cpu")
            if self.host is not None:
                self.host.clear()
            self._prefetched.clear()
            self._labels.clear()
        return len(hashes)

    def clear_disk(self) -> int:
        """Drop L3 (``/flush_cache``): no page is read from disk from now on, its files are deleted behind the
        writes already queued (disk_store.py ``clear``); the pages dropped. Each removal is announced."""
        return self.disk.clear() if self.disk is not None else 0

    def _store(self, key: RadixKey, slots: IndexArray, start: int, host: bool, disk: bool) -> None:
        """Copy the whole tier pages of ``key[start:]`` into the tiers asked for that lack them."""
        with self.lock:
            self._store_locked(key, slots, start, host, disk)

    def _store_locked(self, key: RadixKey, slots: IndexArray, start: int, host: bool, disk: bool) -> None:
        size, disk_store = self.page_tokens, self.disk if disk else None
        host_store = self.host if host else None
        hashes = self.hashes(key, len(slots))
        todo = []  # (page index, to host, to disk)
        for index in range(start // size, len(hashes)):
            to_host = host_store is not None and hashes[index] not in host_store
            to_disk = disk_store is not None and hashes[index] not in disk_store
            if to_host or to_disk:
                todo.append((index, to_host, to_disk))
        if not todo:
            return
        rows = np.concatenate([slots[index * size : (index + 1) * size] for index, _, _ in todo])
        pages = self.mover.split_pages(self.mover.gather(rows))  # one copy per layer for all of them
        for (index, to_host, to_disk), page in zip(todo, pages):
            label = self.label(key, hashes, index)
            if to_host:
                self._to_host(hashes[index], page, label)
            if to_disk:
                self._to_disk(hashes[index], page, label)

    def _to_host(self, page_hash: bytes, page: Any, label: PageLabel | None) -> None:
        """Copy ``page`` into L2 (under ``lock``); what L2 evicts for it spills to L3 with its label."""
        assert self.host is not None
        self.stats.bytes_stored["host"] += int(page.numel() * page.element_size())
        for old_hash, old_page in self.host.put(page_hash, page):
            old_label = label if old_hash == page_hash else self._labels.pop(old_hash, None)
            self._prefetched.discard(old_hash)
            self._dropped(old_hash, "cpu")
            self.stats.host_evicted_pages += old_hash != page_hash
            if self.disk is not None and old_hash not in self.disk:
                self._to_disk(old_hash, old_page, old_label)
        if label is not None and page_hash in self.host:
            self._labels[page_hash] = label
            self._stored(page_hash, "cpu", label)

    def _to_disk(self, page_hash: bytes, page: Any, label: PageLabel | None) -> bool:
        """Queue ``page`` and its label for the disk; False if the store did not take it (read-only, or held)."""
        assert self.disk is not None
        data = self.mover.to_bytes(page)
        if not self.disk.put(page_hash, data, encode_label(label) if label is not None else b""):
            return False  # a read-only store takes nothing: announce nothing
        self.stats.bytes_stored["disk"] += len(data)
        self._stored(page_hash, "disk", label)
        return True
