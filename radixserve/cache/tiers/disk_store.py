"""DiskPageStore: the L3 tier, one checksummed file per tier page under a cache directory.

The directory (lock, fingerprint, warm-restart scan) is opened by ``disk_dir``; each page
file's format and checks are ``disk_format``'s. This module keeps the index of pages (LRU
order, bounded in bytes) and the writer thread.

A page is stored with a label: bytes this store only keeps and checks (the cache layer's
``PageLabel``, so a restart can announce what each page holds). ``labels`` reads them
back from the files' headers alone, for every page a start found.

Safety before speed: a page is returned only if its file passes ``decode_page``, else it
is dropped and counted. Writes run on a writer thread (the step loop only enqueues); disk
full or an unwritable directory turns writing off with one warning and fails no request.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.cache.tiers.disk_dir import check_fingerprint, scan_pages, take_lock
from radixserve.cache.tiers.disk_format import (
    decode_page,
    encode_page,
    fingerprint_digest,
    page_name,
    page_path,
    read_label,
    write_atomic,
)

logger = logging.getLogger(__name__)


@dataclass
class DiskStats:
    pages_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    corrupt: int = 0  # failed a header or checksum check: dropped, recomputed
    missing: int = 0  # indexed but gone when read (deleted under us)
    unreadable: int = 0  # could not be read (a directory, permissions, an I/O error, a stray name): dropped
    write_errors: int = 0
    evicted: int = 0  # deleted to stay within the capacity


class DiskPageStore:
    def __init__(self, directory: str | Path, capacity_bytes: int, fingerprint: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.digest = fingerprint_digest(fingerprint)
        self.stats = DiskStats()
        self.enabled = False  # usable at all (fingerprint matched, directory readable)
        self.writable = False  # we hold the lock and writing has not failed
        self.used_bytes = 0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # page hash -> file size, least recent first
        self._pending: dict[bytes, tuple[bytes, bytes]] = {}  # (payload, label) enqueued: readable meanwhile
        self._mutex = threading.Lock()
        # the writer's work, in order: a page to write, a list of pages to delete (a ``clear``), None: stop
        self._queue: queue.Queue[tuple[bytes, bytes, bytes] | list[bytes] | None] = queue.Queue()
        self._lock_fd: int | None = None
        self._writer: threading.Thread | None = None
        # Called with a page's hash once it leaves the store (evicted, corrupt, missing, or a queued write
        # that failed), on whichever thread dropped it (the writer's, a reader's): it must be thread-safe.
        self.on_drop: Callable[[bytes], None] | None = None
        try:
            self._open()
        except OSError as exc:
            logger.warning("cache dir %s unusable (%s): running without the disk tier", self.directory, exc)
            self.enabled = self.writable = False

    def _open(self) -> None:
        self._lock_fd, self.writable = take_lock(self.directory)
        if not check_fingerprint(self.directory, self.fingerprint, self.writable, self._write_file):
            self.writable = False
            return
        self.enabled = True
        pages, skipped = scan_pages(self.directory, self.writable)
        self.stats.unreadable += skipped
        for page_hash, size in pages:
            self._index[page_hash] = size
            self.used_bytes += size
        if self.writable:
            self._writer = threading.Thread(target=self._write_loop, name="cache-dir-writer", daemon=True)
            self._writer.start()

    # ---- the tier interface -----------------------------------------------------------------

    def __contains__(self, page_hash: bytes) -> bool:
        with self._mutex:
            return page_hash in self._index or page_hash in self._pending

    def __len__(self) -> int:
        with self._mutex:
            return len(self._index.keys() | self._pending.keys())

    def hashes(self) -> list[bytes]:
        """Every page held (on disk, least recently used first, then queued): at a start, the warm scan's."""
        with self._mutex:
            return [*self._index, *(h for h in self._pending if h not in self._index)]

    def put(self, page_hash: bytes, payload: bytes, label: bytes = b"") -> bool:
        """Enqueue one page and its label for the writer thread; False when writing is off or it is there already."""
        with self._mutex:
            if not self.writable or page_hash in self._index or page_hash in self._pending:
                return False
            self._pending[page_hash] = (payload, label)
        self._queue.put((page_hash, payload, label))
        return True

    def labels(self) -> list[tuple[bytes, bytes]]:
        """Every page held, as ``hashes`` orders them, with its label (b"": none, a version 1 file).

        Reads each file's header and label, not its K/V bytes: for a start's pages. A
        page whose header or label fails its check is dropped and counted as corrupt,
        one gone meanwhile as missing, as ``get`` would; neither is listed.
        """
        with self._mutex:
            on_disk = list(self._index)
            queued = [(page_hash, label) for page_hash, (_, label) in self._pending.items()]
        found, pages, start = [], os.path.join(self.directory, "pages"), time.monotonic()
        for page_hash in on_disk:
            try:
                label = read_label(os.path.join(pages, page_name(page_hash)), page_hash, self.digest)
            except FileNotFoundError:
                self._count(missing=1)
                self._forget(page_hash, unlink=False)
                continue
            except OSError as exc:
                self._drop_unreadable(page_hash, exc)
                continue
            if label is None:
                self.drop_corrupt(page_hash)
            else:
                found.append((page_hash, label))
        logger.info("cache dir %s: %d page labels read in %.2f s", self.directory, len(found), time.monotonic() - start)
        listed = set(on_disk)
        return found + [(page_hash, label) for page_hash, label in queued if page_hash not in listed]

    def get(self, page_hash: bytes) -> bytes | None:
        """The page's payload, verified; None when absent, missing or corrupt (counted, dropped)."""
        with self._mutex:
            pending = self._pending.get(page_hash)
            known = page_hash in self._index
            if known:
                self._index.move_to_end(page_hash)
        if pending is not None:
            return pending[0]
        if not known or not self.enabled:
            return None
        try:
            data = self._path(page_hash).read_bytes()
        except FileNotFoundError:
            self._count(missing=1)
            self._forget(page_hash, unlink=False)
            return None
        except OSError as exc:
            self._drop_unreadable(page_hash, exc)
            return None
        payload = decode_page(page_hash, self.digest, data)
        if payload is None:
            self.drop_corrupt(page_hash)
            return None
        self._count(pages_read=1, bytes_read=len(payload))
        return payload

    def state(self, page_hash: bytes) -> str:
        """This page's L3 state: ``queued`` (bytes held for the writer), ``on_disk`` or ``absent``."""
        with self._mutex:
            if page_hash in self._pending:
                return "queued"
            return "on_disk" if page_hash in self._index else "absent"

    def drop_corrupt(self, page_hash: bytes) -> None:
        """Drop a page that failed a check (here, or its caller's check of its label): counted as corrupt."""
        self._count(corrupt=1)
        logger.warning("cache dir page %s failed its check: dropped, will be recomputed", page_hash.hex())
        self._forget(page_hash, unlink=self.writable)

    def _drop_unreadable(self, page_hash: bytes, exc: OSError) -> None:
        """Drop a page whose file cannot be read (a directory in its place, permissions, an I/O error): counted,
        recomputed like a corrupt one; never an error for the request that asked."""
        self._count(unreadable=1)
        logger.warning("cache dir page %s unreadable (%s): dropped, will be recomputed", page_hash.hex(), exc)
        self._forget(page_hash, unlink=self.writable)

    def clear(self) -> int:
        """Drop every page (``/flush_cache``): none is served from now on; the pages held. The files are
        deleted by the writer thread, after the writes queued before, so a caller never waits on the disk
        (``flush`` waits for it); the directory, its lock and fingerprint stay. A store that never held the
        directory's lock (another server's) only forgets its pages: their files are not ours to delete. One
        that holds it but turned read-only (disk full) still deletes them."""
        with self._mutex:
            gone = [*self._index, *(h for h in self._pending if h not in self._index)]
            self._index.clear()
            self._pending.clear()  # a queued write finds its page gone and skips it
            self.used_bytes = 0
        if self._writer is not None and self._writer.is_alive():  # the writer runs iff we hold the lock
            self._queue.put(gone)
        if self.on_drop is not None:
            for page_hash in gone:
                self.on_drop(page_hash)
        return len(gone)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every enqueued page to reach the disk; True if all did."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._writer is not None and self._writer.is_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush (up to ``timeout``), stop the writer, release the lock."""
        self.flush(timeout)
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self.writable = False

    # ---- internals --------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        """Add to the counters under the mutex: the step loop, the writer and the prefetcher all count."""
        with self._mutex:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def _path(self, page_hash: bytes) -> Path:
        return page_path(self.directory, page_hash)

    def _write_file(self, path: Path, data: bytes) -> None:
        """Every file this store writes goes through here (tests inject disk faults at this point)."""
        write_atomic(path, data)

    def _forget(self, page_hash: bytes, unlink: bool) -> None:
        with self._mutex:
            size = self._index.pop(page_hash, None)
            if size is not None:
                self.used_bytes -= size
        if unlink:
            path = self._path(page_hash)
            try:
                path.unlink(missing_ok=True)
            except IsADirectoryError:  # a directory in the page's place would block its next write
                shutil.rmtree(path, ignore_errors=True)
            except OSError as exc:  # a read-only mount: the index forgets it anyway
                logger.warning("cache dir %s: could not delete page %s (%s)", self.directory, page_hash.hex(), exc)
        if size is not None and self.on_drop is not None:
            self.on_drop(page_hash)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, list):
                    self._delete_pages(item)
                else:
                    self._write_page(*item)
            finally:
                self._queue.task_done()

    def _write_page(self, page_hash: bytes, payload: bytes, label: bytes) -> None:
        if not self._queued(page_hash, payload):
            return  # cleared since it was queued (a put after the clear queued its own write)
        data = encode_page(page_hash, self.digest, payload, label)
        written = False
        try:
            if self.writable:
                self._make_room(len(data))
                self._write_file(self._path(page_hash), data)
                written = True
        except OSError as exc:
            self._disable_writes(exc)
        with self._mutex:  # queued -> on disk in one step: never in neither state
            if not self._queued(page_hash, payload):
                return  # cleared while it was written: the clear's delete, queued behind, removes the file
            self._pending.pop(page_hash)
            if written:
                self._index[page_hash] = len(data)
                self.used_bytes += len(data)
        if written:
            self._count(pages_written=1, bytes_written=len(payload))
        elif self.on_drop is not None:
            self.on_drop(page_hash)  # it was readable while queued: now it is gone

    def _queued(self, page_hash: bytes, payload: bytes) -> bool:
        """Is this write (``payload``, by identity) still the one queued for ``page_hash``? Not once a ``clear``
        dropped it. Read without the mutex it is a hint; under it, the answer."""
        pending = self._pending.get(page_hash)
        return pending is not None and pending[0] is payload

    def _delete_pages(self, gone: list[bytes]) -> None:
        """A ``clear``'s files (the writer thread): those a later put wrote again are not in the list's past."""
        for page_hash in gone:
            with self._mutex:
                if page_hash in self._index or page_hash in self._pending:
                    continue  # stored again since the clear: a later write owns the file
            try:
                self._path(page_hash).unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("cache dir %s: could not delete page %s (%s)", self.directory, page_hash.hex(), exc)

    def _make_room(self, size: int) -> None:
        while True:
            with self._mutex:
                if self.used_bytes + size <= self.capacity_bytes or not self._index:
                    return
                old = next(iter(self._index))
            self._forget(old, unlink=True)
            self._count(evicted=1)

    def _disable_writes(self, exc: OSError) -> None:
        self._count(write_errors=1)
        if self.writable:
            why = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
            logger.warning("cache dir %s: write failed (%s): disk tier goes read-only", self.directory, why)
        self.writable = False
        with self._mutex:
            self._pending.clear()
