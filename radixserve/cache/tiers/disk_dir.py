"""Opening an L3 cache directory: who may write it, whose pages it holds, what is already there.

    <dir>/fingerprint.json      what wrote these pages: weights, dtype, page size, tokenizer, KV layout
    <dir>/lock                  flock'ed by the one server that may write (others read only)
    <dir>/pages/                the page files (see disk_format)

A directory whose fingerprint differs from ours is not used at all (one log line):
never wrong KV. A second server finds the lock held and reads only, so two servers
never write one directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.cache.tiers.disk_format import PAGE_SUFFIX, TEMP_SUFFIX

logger = logging.getLogger(__name__)

PROGRESS_EVERY = 10000  # pages between two "indexing" log lines on a large warm restart


def take_lock(directory: Path) -> tuple[int, bool]:
    """Create the directory, open its lock file; (fd, True) if we hold the lock (may write)."""
    (directory / "pages").mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
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
            "cache dir %s was written for another model or layout (differs in %s): not using it", directory, differs
        )
        return False
    return True


def scan_pages(directory: Path, writable: bool) -> list[tuple[bytes, int]]:
    """The page files already there (a warm restart) as (page hash, file size), oldest first.

    A writer also removes the temp files a crash left behind mid-write.
    """
    start, found = time.monotonic(), []
    for path in (directory / "pages").glob("*/*"):
        if path.suffix == PAGE_SUFFIX and len(path.stem) == 32:
            stat = path.stat()
            found.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
        elif writable and path.name.endswith(TEMP_SUFFIX):
            path.unlink(missing_ok=True)
        if len(found) % PROGRESS_EVERY == 0 and found:
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
    return pages
