"""Opening an L3 cache directory: who may write it, whose pages it holds, what is already there.

    <dir>/fingerprint.json      what wrote these pages: weights, dtype, page size, tokenizer, KV layout
    <dir>/lock                  flock'ed by the one server that may write (others read only)
    <dir>/pages/                the page files (see disk_format)

A directory whose fingerprint differs from ours is not used at all (one log line):
never wrong KV. A second server finds the lock held and reads only, so two servers
never write one directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.cache.tiers.disk_format import PAGE_SUFFIX, TEMP_SUFFIX

logger = logging.getLogger(__name__)

PROGRESS_EVERY = 10000  # pages between two "indexing" log lines on a large warm restart


# A directory we may read but not write (a read-only mount, another user's files): read it, write nothing.
_READ_ONLY_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS)


def take_lock(directory: Path) -> tuple[int | None, bool]:
    """Create the directory, open its lock file; (fd, True) if we hold the lock (may write). A directory that
    exists but cannot be written is read without a lock: (None, False)."""
    try:
        (directory / "pages").mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in _READ_ONLY_ERRORS or not (directory / "pages").is_dir():
            raise
        logger.warning("cache dir %s cannot be written (%s): using it read-only", directory, exc.strerror)
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, True
    except BlockingIOError:
        logger.warning("cache dir %s is locked by another server: using it read-only", directory)
        return fd, False
    except OSError:
        os.close(fd)
        raise


def check_fingerprint(
    directory: Path, fingerprint: dict[str, Any], writable: bool, write_file: Callable[[Path, bytes], None]
) -> bool:
    """True if the directory is ours to use; a new one is claimed with our fingerprint (if writable)."""
    path = directory / "fingerprint.json"
    if not path.exists():
        if not writable:
            return False
        write_file(path, json.dumps(fingerprint, sort_keys=True, indent=1).encode())
        return True
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError):
        theirs = None
    if theirs != fingerprint:
        differs = sorted(k for k in {**fingerprint, **(theirs or {})} if (theirs or {}).get(k) != fingerprint.get(k))
        logger.warning(
            "cache dir %s was written for another model or layout (differs in %s%s): not using it",
            directory,
            differs,
            _layout_change((theirs or {}).get("kv_layout"), fingerprint.get("kv_layout")),
        )
        return False
    return True


def _layout_change(theirs: Any, ours: Any) -> str:
    """What differs in the KV layout (the KV dtype: a restart with another --kv-cache-dtype), for the log line."""
    if not isinstance(theirs, dict) or not isinstance(ours, dict) or theirs == ours:
        return ""
    fields = sorted(k for k in {**theirs, **ours} if theirs.get(k) != ours.get(k))
    return "; kv_layout " + ", ".join(f"{k}: {theirs.get(k)} in the files, {ours.get(k)} now" for k in fields)


def page_hash_of(name: str) -> bytes | None:
    """The page hash a file name stands for (32 hex digits + PAGE_SUFFIX), or None for any other name."""
    stem, suffix = os.path.splitext(name)
    if suffix != PAGE_SUFFIX or len(stem) != 32:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def scan_pages(directory: Path, writable: bool) -> tuple[list[tuple[bytes, int]], int]:
    """The page files already there (a warm restart) as (page hash, file size), oldest first, and how many
    entries were skipped as unusable: a stray name, a directory or other non-file where a page should be, one
    that cannot be stat'ed. A writer also removes the temp files a crash left behind mid-write, and directories
    under a page's name (they would block that page's write)."""
    start, found, skipped = time.monotonic(), [], 0
    for path in (directory / "pages").glob("*/*"):
        if writable and path.name.endswith(TEMP_SUFFIX):
            path.unlink(missing_ok=True)
            continue
        page_hash = page_hash_of(path.name)
        try:
            info = path.lstat()
        except OSError:
            info = None
        if page_hash is None or info is None or not stat.S_ISREG(info.st_mode):
            skipped += 1
            logger.warning("cache dir %s: skipping %s (not a page file)", directory, path)
            if writable and page_hash is not None and info is not None and stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            continue
        found.append((info.st_mtime, page_hash, info.st_size))
        if len(found) % PROGRESS_EVERY == 0:
            logger.info("cache dir %s: indexing, %d pages so far", directory, len(found))
    pages = [(page_hash, size) for _, page_hash, size in sorted(found)]
    logger.info(
        "cache dir %s: %d pages (%.1f MiB) indexed in %.2f s%s",
        directory,
        len(pages),
        sum(size for _, size in pages) / 2**20,
        time.monotonic() - start,
        "" if writable else " (read-only)",
    )
    return pages, skipped
