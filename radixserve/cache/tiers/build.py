"""Wiring the L2 / L3 tiers under a cache, and the fingerprint that binds a cache directory.

The fingerprint names everything that changes what K/V a token gets or how a
page is laid out: the weights (a hash of the model's files), the dtype, the
cache and tier page sizes, the tokenizer (a hash of how it encodes a probe text,
next to its files' hash), the KV layout and the quantization. A directory
written under any other fingerprint is not used.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from radixserve.cache.events import KVEventLog
from radixserve.cache.tiers.disk_store import DiskPageStore
from radixserve.cache.tiers.host_arena import HostArena
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import PoolPageMover, tier_page_tokens
from radixserve.cache.tiers.options import ModelIdentity, TierConfig
from radixserve.memory.kv_pool import KVPool

logger = logging.getLogger(__name__)

GIB = 1 << 30
UNBOUNDED_BYTES = 1 << 62  # the disk tier's capacity without --cache-dir-size
FINGERPRINT_VERSION = 1
TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog. 0123456789 <|im_start|> ÄÖü 日本語 \n\t"


def files_digest(path: str | Path) -> str:
    """blake2b over the model's files (one file, or every file of a folder): read once at start."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(str(file.relative_to(root) if root.is_dir() else file.name).encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def fingerprint(config: TierConfig, model: ModelIdentity, mover: PoolPageMover) -> dict[str, Any]:
    start = time.monotonic()
    weights = files_digest(model.path)
    probe = model.encode(TOKENIZER_PROBE)
    logger.info("cache dir fingerprint: model files hashed in %.1f s", time.monotonic() - start)
    return {
        "version": FINGERPRINT_VERSION,
        "weights": weights,
        "tokenizer": hashlib.blake2b(repr(list(probe)).encode(), digest_size=16).hexdigest(),
        "page_size": config.page_size,
        "quantization": model.quantization,  # resolved: auto on another file or machine may differ
        "kv_layout": mover.layout.describe(),
    }


def build_tiers(
    config: TierConfig, model: ModelIdentity, pool: KVPool, events: KVEventLog | None = None
) -> TierIndex | None:
    """The tier index for ``config`` (None when neither ``hicache_size`` nor ``cache_dir`` is set).

    Build it before the cache and hand it to the cache's constructor (``tiers=``). ``events``: the log
    the cache will report to (one of its ``listeners``); what each tier gains and loses is announced there too.
    """
    if not config.hicache_size and config.cache_dir is None:
        return None
    mover = PoolPageMover(pool, tier_page_tokens(config.page_size))
    host = None
    if config.hicache_size:
        host = HostArena(int(config.hicache_size * GIB), config.hicache_compress, pin=pool.device.type == "cuda")
    disk = None
    if config.cache_dir is not None:
        capacity = int(config.cache_dir_size * GIB) if config.cache_dir_size is not None else UNBOUNDED_BYTES
        disk = DiskPageStore(config.cache_dir, capacity, fingerprint(config, model, mover))
    policy = config.hicache_write_policy
    tiers = TierIndex(mover, mover.layout.page_tokens, host, disk, policy, events=events)  # type: ignore[arg-type]
    logger.info("cache tiers: %s", tiers.sizes())
    return tiers
