"""The L3 page file format: what one page file holds and how it is checked.

    <dir>/pages/ab/abcd...kv    64-byte header (magic, page hash, fingerprint digest, payload
                                checksum, payload length) + the page's raw K/V bytes

A page is trusted only if its header names this page and this directory's fingerprint
and its checksum matches: a torn, truncated, flipped or misnamed file reads as absent.
Files appear by rename, so a crash mid-write leaves a stray temp file, never a torn page.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

MAGIC = b"RSKVPG01"
HEADER = struct.Struct("<8s16s16s16sQ")
PAGE_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


def fingerprint_digest(fingerprint: dict[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(), digest_size=16).digest()


def page_path(directory: Path, page_hash: bytes) -> Path:
    """Where a page lives: fanned out over 256 subdirectories by its hash's first byte."""
    name = page_hash.hex()
    return directory / "pages" / name[:2] / f"{name}{PAGE_SUFFIX}"


def encode_page(page_hash: bytes, digest: bytes, payload: bytes) -> bytes:
    """A page file's bytes: the header, then the payload it checksums."""
    checksum = hashlib.blake2b(payload, digest_size=16).digest()
    return HEADER.pack(MAGIC, page_hash, digest, checksum, len(payload)) + payload


def decode_page(page_hash: bytes, digest: bytes, data: bytes) -> bytes | None:
    """The payload of a page file if it is this page, of this fingerprint, intact; else None."""
    if len(data) < HEADER.size:
        return None
    magic, stored_hash, stored_digest, checksum, length = HEADER.unpack_from(data)
    payload = data[HEADER.size :]
    if (magic, stored_hash, stored_digest, length) != (MAGIC, page_hash, digest, len(payload)):
        return None
    return payload if hashlib.blake2b(payload, digest_size=16).digest() == checksum else None


def write_atomic(path: Path, data: bytes) -> None:
    """Atomically create ``path`` holding ``data`` (a temp file, then a rename)."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    try:
        with open(tmp, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
