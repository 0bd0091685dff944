"""The L3 page file format: what one page file holds and how it is checked.

    <dir>/pages/ab/abcd...kv    84-byte header (magic, page hash, fingerprint digest, payload
                                checksum, label checksum, payload and label lengths), the
                                page's label (opaque here: what the cache layer announces the
                                page with), then the page's raw K/V bytes

A page is trusted only if its header names this page and this directory's fingerprint
and both checksums match: a torn, truncated, flipped or misnamed file reads as absent.
The label sits before the K/V bytes so a start reads it with the header alone
(``read_label``), never the payload. Files appear by rename, so a crash mid-write
leaves a stray temp file, never a torn page.

Version 1 files (``RSKVPG01``: a 64-byte header, no label) are still read: their
K/V loads as before and their label is empty (the page is announced by hash only).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

MAGIC = b"RSKVPG02"
HEADER = struct.Struct("<8s16s16s16s16sQI")  # magic, hash, digest, payload sum, label sum, payload len, label len
MAGIC_V1 = b"RSKVPG01"
HEADER_V1 = struct.Struct("<8s16s16s16sQ")  # magic, hash, digest, payload sum, payload len
HEAD_READ = 4096  # what ``read_label`` reads first: a header and any label of up to 4 KiB
PAGE_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


def fingerprint_digest(fingerprint: dict[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(), digest_size=16).digest()


def page_path(directory: Path, page_hash: bytes) -> Path:
    """Where a page lives: fanned out over 256 subdirectories by its hash's first byte."""
    return directory / "pages" / page_name(page_hash)


def page_name(page_hash: bytes) -> str:
    """A page file's path under ``<dir>/pages`` (a string: a start joins 10,000s, and ``Path`` joins cost µs)."""
    name = page_hash.hex()
    return f"{name[:2]}/{name}{PAGE_SUFFIX}"


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def encode_page(page_hash: bytes, digest: bytes, payload: bytes, label: bytes = b"") -> bytes:
    """A page file's bytes: the header, the label, then the payload."""
    header = HEADER.pack(MAGIC, page_hash, digest, _checksum(payload), _checksum(label), len(payload), len(label))
    return header + label + payload


class Layout(NamedTuple):
    """Where a page file's label and payload lie, and their checksums, as its header says."""

    label: slice
    payload: slice
    label_sum: bytes | None  # None: a version 1 file, which has no label
    payload_sum: bytes


def parse_header(page_hash: bytes, digest: bytes, head: bytes, size: int) -> Layout | None:
    """The layout of a ``size``-byte page file starting with ``head``, if its header names this page and this
    fingerprint and accounts for exactly ``size`` bytes (a truncated file fails here); else None."""
    if head[:8] == MAGIC and len(head) >= HEADER.size:
        _, stored_hash, stored_digest, payload_sum, label_sum, length, label_len = HEADER.unpack_from(head)
        start: int = HEADER.size + label_len
        layout = Layout(slice(HEADER.size, start), slice(start, size), label_sum, payload_sum)
    elif head[:8] == MAGIC_V1 and len(head) >= HEADER_V1.size:
        _, stored_hash, stored_digest, payload_sum, length = HEADER_V1.unpack_from(head)
        start = HEADER_V1.size
        layout = Layout(slice(start, start), slice(start, size), None, payload_sum)
    else:
        return None
    if (stored_hash, stored_digest, length) != (page_hash, digest, size - start):
        return None
    return layout


def decode_page(page_hash: bytes, digest: bytes, data: bytes) -> bytes | None:
    """The payload of a page file if it is this page, of this fingerprint, intact (its label too); else None."""
    layout = parse_header(page_hash, digest, data, len(data))
    if layout is None or (layout.label_sum is not None and _checksum(data[layout.label]) != layout.label_sum):
        return None
    payload = data[layout.payload]
    return payload if _checksum(payload) == layout.payload_sum else None


def read_label(path: str | Path, page_hash: bytes, digest: bytes) -> bytes | None:
    """The label a page file holds (b"": none, a version 1 file), from one read of the file's head (the header,
    the label, the start of the payload at most), never the whole payload; None if the header is not this page's
    or does not account for the file's size, or the label fails its checksum. ``FileNotFoundError``: it is gone."""
    fd = os.open(path, os.O_RDONLY)  # unbuffered: one read of the head, no buffer to fill
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, HEAD_READ)
        layout = parse_header(page_hash, digest, head, size)
        if layout is None:
            return None
        if layout.label.stop > len(head):  # a label longer than the first read: read the rest of it
            head += os.pread(fd, layout.label.stop - len(head), len(head))
    finally:
        os.close(fd)
    label = head[layout.label]
    if layout.label_sum is not None and _checksum(label) != layout.label_sum:
        return None
    return label


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
