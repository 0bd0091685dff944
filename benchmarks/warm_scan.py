"""What a warm restart's disk costs before the first request: the scan, reading labels, the first publish.

    radixserve bench warm-scan --pages 10000 [--dir /tmp/warm] [--rounds 3]

Fills a cache directory once (sequences of 16 tier pages, through a ``RadixCache``
and its tiers, as a server would write them), then in each round times, in a fresh
process: opening the ``DiskPageStore`` (the warm scan), building the tiers with the
KV event log (which reads every page's label from its header), and the first drain
turned into one wire batch (the scheduler thread's first publish). A checkout from
before the tiers took their log at construction (issue 29) needs its own copy of this
file. The page files were just written, so they sit in the page cache: a cold disk adds its reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from radixserve.cache import KVEventLog, RadixCache, RadixKey
from radixserve.cache.tiers.disk_store import DiskPageStore
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import PoolPageMover
from radixserve.kv_events.wire import BlockStored, encode_batch, event_record
from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool

PAGE_TOKENS, PAGES_PER_SEQUENCE = 16, 16


def tiered(directory: Path, events: bool) -> tuple[RadixCache, TierIndex, float, float]:
    """A cache over the directory's disk tier; how long opening the directory (its warm scan) took, and then
    building the tiers (with events: reading every page's label from its header, to announce it)."""
    size = PAGE_TOKENS * PAGES_PER_SEQUENCE
    log = KVEventLog(1) if events else None
    mover = PoolPageMover(KVPool(1, size + 1, 1, 2), PAGE_TOKENS)
    began = time.perf_counter()
    disk = DiskPageStore(directory, 1 << 40, {"bench": "warm_scan"})
    scan, began = time.perf_counter() - began, time.perf_counter()
    tiers = TierIndex(mover, PAGE_TOKENS, None, disk, events=log)
    attach = time.perf_counter() - began
    cache = RadixCache(TokenAllocator(size), 1, listeners=[log] if log is not None else [], tiers=tiers)
    return cache, tiers, scan, attach


def fill(directory: Path, pages: int) -> None:
    cache, tiers, _, _ = tiered(directory, events=False)
    rng = np.random.default_rng(0)
    for _ in range(pages // PAGES_PER_SEQUENCE):
        tokens = rng.integers(3, 50_000, PAGE_TOKENS * PAGES_PER_SEQUENCE)
        req = cache.open_request(RadixKey(tokens))
        assert cache.extend_request(req, tokens)
        cache.cache_finished_req(req)
        cache.evict(len(tokens))  # every page to the disk
    assert tiers.close(600)


def measure(directory: Path) -> dict[str, float]:
    cache, tiers, scan, attach = tiered(directory, events=True)
    assert cache.events is not None
    full_gcs, began = gc.get_stats()[2]["collections"], time.perf_counter()
    records = [r for r in (event_record(e, PAGE_TOKENS) for e in cache.events.drain()) if r is not None]
    data = encode_batch(records)
    publish = time.perf_counter() - began
    full_gcs = gc.get_stats()[2]["collections"] - full_gcs  # a full collection in there costs ~0.1 s here
    full = sum(isinstance(r, BlockStored) and len(r.token_ids) > 0 for r in records)
    tiers.close(5)
    return {
        "pages": len(records),
        "in_full": full,
        "scan_s": scan,
        "attach_s": attach,
        "publish_s": publish,
        "batch_mib": len(data) / 2**20,
        "full_gcs": full_gcs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench warm-scan", description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=10_000)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one round, in this process
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="warm_scan"))
    if args.measure:
        print(json.dumps(measure(directory)))
        return
    if not (directory / "pages").exists():
        began = time.perf_counter()
        fill(directory, args.pages)
        print(f"filled {directory} in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    for _ in range(args.rounds):
        out = subprocess.run(
            [sys.executable, __file__, "--dir", str(directory), "--measure"], check=True, capture_output=True, text=True
        )
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
