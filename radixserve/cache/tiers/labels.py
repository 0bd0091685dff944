"""A tier page's label as bytes: what the disk tier keeps in each page file's header, checked when read back.

    16 bytes    the parent page's hash (zeros for a sequence's first page)
    1 byte      flags: 1 = it has a parent, 2 = it has a namespace (``extra_key``)
    4 bytes     shared_len (u32 LE)
    4 bytes     n, the namespace's length in bytes (u32 LE)
    n bytes     the namespace (UTF-8)
    8 x t       the page's tokens (int64 LE), t = the tier page

The file's checksum catches a label damaged on disk; ``decode_label`` also asks
that the label hash to its page's name (a page hash is the chained hash of exactly
its parent, namespace and tokens), so a label written for another page, or by a
writer with a bug, is never announced: it fails the page's check like corrupt bytes.
"""

from __future__ import annotations

import struct

import numpy as np

from radixserve.cache.core.key import ROOT_HASH, chain_hash
from radixserve.cache.events import PageLabel

LABEL = struct.Struct("<16sBII")  # parent hash, flags, shared_len, namespace length
HAS_PARENT, HAS_NAMESPACE = 1, 2


def encode_label(label: PageLabel) -> bytes:
    namespace = label.extra_key.encode() if label.extra_key is not None else b""
    flags = (HAS_PARENT if label.parent_hash is not None else 0) | (HAS_NAMESPACE if label.extra_key is not None else 0)
    head = LABEL.pack(label.parent_hash or ROOT_HASH, flags, label.shared_len, len(namespace))
    return head + namespace + np.ascontiguousarray(label.token_ids, dtype="<i8").tobytes()


def decode_label(data: bytes, page_hash: bytes, page_tokens: int) -> PageLabel | None:
    """The label in ``data`` if it is well formed, holds ``page_tokens`` tokens and hashes to ``page_hash``."""
    if len(data) < LABEL.size:
        return None
    parent, flags, shared_len, namespace_len = LABEL.unpack_from(data)
    start = LABEL.size + namespace_len
    if flags & ~(HAS_PARENT | HAS_NAMESPACE) or len(data) != start + 8 * page_tokens:
        return None
    try:
        extra_key = data[LABEL.size : start].decode() if flags & HAS_NAMESPACE else None
    except UnicodeDecodeError:
        return None
    tokens = np.frombuffer(data, dtype="<i8", offset=start).astype(np.int64)
    chained_from = parent if flags & HAS_PARENT else ROOT_HASH
    # A page in a key's shared head is hashed in the shared namespace (``None``'s), whatever its own.
    if chain_hash(chained_from, extra_key, tokens) != page_hash:
        if extra_key is None or chain_hash(chained_from, None, tokens) != page_hash:
            return None
    return PageLabel(parent if flags & HAS_PARENT else None, tokens, extra_key, shared_len)
