"""DiskPageStore: the L3 tier, one checksummed file per tier page under a cache directory.

    <dir>/fingerprint.json      what wrote these pages: weights, dtype, page size, tokenizer, KV layout
    <dir>/lock                  flock'ed by the one server that may write (others read only)
    <dir>/pages/ab/abcd...kv    64-byte header (magic, page hash, fingerprint digest, payload
                                checksum, payload length) + the page's raw K/V bytes

Safety before speed: a directory whose fingerprint differs from ours is not used
at all (one log line); a page is returned only if its header names this page and
this fingerprint and its checksum matches, else it is dropped and counted. Files
appear by rename, so a crash mid-write leaves a stray temp file, never a torn page.
Writes run on a writer thread (the step loop only enqueues); disk full or an
unwritable directory turns writing off with one warning and fails no request.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"RSKVPG01"
HEADER = struct.Struct("<8s16s16s16sQ")


@dataclass
class DiskStats:
    pages_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    corrupt: int = 0  # failed a header or checksum check: dropped, recomputed
    missing: int = 0  # indexed but gone when read (deleted under us)
    write_errors: int = 0
    evicted: int = 0  # deleted to stay within the capacity


def fingerprint_digest(fingerprint: dict[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(), digest_size=16).digest()


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
        self._pending: dict[bytes, bytes] = {}  # enqueued, not yet on disk: readable meanwhile
        self._mutex = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
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

    # ---- opening ----------------------------------------------------------------------------

    def _open(self) -> None:
        (self.directory / "pages").mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.writable = True
        except BlockingIOError:
            logger.warning("cache dir %s is locked by another server: using it read-only", self.directory)
        if not self._check_fingerprint():
            self.writable = False
            return
        self.enabled = True
        self._rebuild_index()
        if self.writable:
            self._writer = threading.Thread(target=self._write_loop, name="cache-dir-writer", daemon=True)
            self._writer.start()

    def _check_fingerprint(self) -> bool:
        path = self.directory / "fingerprint.json"
        if not path.exists():
            if not self.writable:
                return False
            self._write_file(path, json.dumps(self.fingerprint, sort_keys=True, indent=1).encode())
            return True
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError):
            theirs = None
        if theirs != self.fingerprint:
            differs = sorted(
                k for k in {**self.fingerprint, **(theirs or {})} if (theirs or {}).get(k) != self.fingerprint.get(k)
            )
            logger.warning(
                "cache dir %s was written for another model or layout (differs in %s): not using it",
                self.directory,
                differs,
            )
            return False
        return True

    def _rebuild_index(self) -> None:
        """Index the page files already there (a warm restart), oldest first."""
        start, found = time.monotonic(), []
        for path in (self.directory / "pages").glob("*/*"):
            if path.suffix == ".kv" and len(path.stem) == 32:
                stat = path.stat()
                found.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
            elif self.writable and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write a crash interrupted
            if len(found) % 10000 == 0 and found:
                logger.info("cache dir %s: indexing, %d pages so far", self.directory, len(found))
        for _, page_hash, size in sorted(found):
            self._index[page_hash] = size
            self.used_bytes += size
        logger.info(
            "cache dir %s: %d pages (%.1f MiB) indexed in %.2f s%s",
            self.directory,
            len(found),
            self.used_bytes / 2**20,
            time.monotonic() - start,
            "" if self.writable else " (read-only)",
        )

    # ---- the tier interface -----------------------------------------------------------------

    def __contains__(self, page_hash: bytes) -> bool:
        with self._mutex:
            return page_hash in self._index or page_hash in self._pending

    def __len__(self) -> int:
        with self._mutex:
            return len(self._index.keys() | self._pending.keys())

    def put(self, page_hash: bytes, payload: bytes) -> bool:
        """Enqueue one page for the writer thread; False when writing is off or it is there already."""
        with self._mutex:
            if not self.writable or page_hash in self._index or page_hash in self._pending:
                return False
            self._pending[page_hash] = payload
        self._queue.put((page_hash, payload))
        return True

    def get(self, page_hash: bytes) -> bytes | None:
        """The page's payload, verified; None when absent, missing or corrupt (counted, dropped)."""
        with self._mutex:
            pending = self._pending.get(page_hash)
            known = page_hash in self._index
            if known:
                self._index.move_to_end(page_hash)
        if pending is not None:
            return pending
        if not known or not self.enabled:
            return None
        try:
            data = self._path(page_hash).read_bytes()
        except FileNotFoundError:
            self._count(missing=1)
            self._forget(page_hash, unlink=False)
            return None
        payload = self._verify(page_hash, data)
        if payload is None:
            self._count(corrupt=1)
            logger.warning("cache dir page %s failed its check: dropped, will be recomputed", page_hash.hex())
            self._forget(page_hash, unlink=self.writable)
            return None
        self._count(pages_read=1, bytes_read=len(payload))
        return payload

    def _count(self, **deltas: int) -> None:
        """Add to the counters under the mutex: the step loop, the writer and the prefetcher all count."""
        with self._mutex:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def state(self, page_hash: bytes) -> str:
        """This page's L3 state: ``queued`` (bytes held for the writer), ``on_disk`` or ``absent``."""
        with self._mutex:
            if page_hash in self._pending:
                return "queued"
            return "on_disk" if page_hash in self._index else "absent"

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

    def _path(self, page_hash: bytes) -> Path:
        name = page_hash.hex()
        return self.directory / "pages" / name[:2] / f"{name}.kv"

    def _verify(self, page_hash: bytes, data: bytes) -> bytes | None:
        if len(data) < HEADER.size:
            return None
        magic, stored_hash, digest, checksum, length = HEADER.unpack_from(data)
        payload = data[HEADER.size :]
        if (magic, stored_hash, digest, length) != (MAGIC, page_hash, self.digest, len(payload)):
            return None
        return payload if hashlib.blake2b(payload, digest_size=16).digest() == checksum else None

    def _forget(self, page_hash: bytes, unlink: bool) -> None:
        with self._mutex:
            size = self._index.pop(page_hash, None)
            if size is not None:
                self.used_bytes -= size
        if unlink:
            self._path(page_hash).unlink(missing_ok=True)
        if size is not None and self.on_drop is not None:
            self.on_drop(page_hash)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write_page(*item)
            finally:
                self._queue.task_done()

    def _write_page(self, page_hash: bytes, payload: bytes) -> None:
        checksum = hashlib.blake2b(payload, digest_size=16).digest()
        data = HEADER.pack(MAGIC, page_hash, self.digest, checksum, len(payload)) + payload
        written = False
        try:
            if self.writable:
                self._make_room(len(data))
                self._write_file(self._path(page_hash), data)
                written = True
        except OSError as exc:
            self._disable_writes(exc)
        with self._mutex:  # queued -> on disk in one step: never in neither state
            self._pending.pop(page_hash, None)
            if written:
                self._index[page_hash] = len(data)
                self.used_bytes += len(data)
        if written:
            self._count(pages_written=1, bytes_written=len(payload))
        elif self.on_drop is not None:
            self.on_drop(page_hash)  # it was readable while queued: now it is gone

    def _make_room(self, size: int) -> None:
        while True:
            with self._mutex:
                if self.used_bytes + size <= self.capacity_bytes or not self._index:
                    return
                old = next(iter(self._index))
            self._forget(old, unlink=True)
            self._count(evicted=1)

    def _write_file(self, path: Path, data: bytes) -> None:
        """Atomically create ``path`` holding ``data`` (a temp file, then a rename)."""
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as file:
                file.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _disable_writes(self, exc: OSError) -> None:
        self._count(write_errors=1)
        if self.writable:
            why = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
            logger.warning("cache dir %s: write failed (%s): disk tier goes read-only", self.directory, why)
        self.writable = False
        with self._mutex:
            self._pending.clear()
