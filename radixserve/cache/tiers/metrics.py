"""The cache tiers' figures (``--hicache-size`` / ``--cache-dir``) as plain data, read at scrape time.

    radixserve:tier_hit_tokens_total{tier=host|disk}      prompt tokens loaded back instead of recomputed
    radixserve:tier_loaded_bytes_total{tier=host|disk}    K/V bytes copied back into the pool
    radixserve:tier_stored_bytes_total{tier=host|disk}    K/V bytes copied down
    radixserve:tier_load_seconds                          histogram: one continuation fetched and verified
    radixserve:tier_used_bytes{tier=host|disk}            what each tier holds now
    radixserve:tier_disk_faults_total{kind=corrupt|missing|unreadable|write_error}

The server renders each ``Figure`` as a Prometheus family (server/tier_metrics.py's
``TierCollector``): which figures there are and what they count stays here,
beside the counters; the exposition format stays with the server.

The scheduler thread owns the counters; a scrape reads plain ints (a value may
lag one step behind, never tear).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.pages import LOAD_BUCKETS_S

FigureKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Figure:
    """One metric family: ``samples`` by label value (``label`` names the label; "" for one unlabelled value).

    A histogram's samples are its cumulative buckets (upper bound, count) and ``total`` the sum observed.
    """

    name: str  # without the server's prefix
    doc: str
    kind: FigureKind
    label: str = ""
    samples: tuple[tuple[str, float], ...] = ()
    total: float = 0.0


def tier_figures(tiers: TierIndex) -> Iterator[Figure]:
    stats = tiers.stats
    for name, doc, values in (
        ("tier_hit_tokens", "Prompt tokens loaded back from a tier.", stats.hit_tokens),
        ("tier_loaded_bytes", "K/V bytes loaded back into the pool.", stats.bytes_loaded),
        ("tier_stored_bytes", "K/V bytes copied down into a tier.", stats.bytes_stored),
    ):
        yield Figure(name, doc, "counter", "tier", tuple(values.items()))
    yield _latency(tiers)
    for name, doc, value in (
        (
            "tier_prefetched_pages",
            "Disk pages a queued request's prefetch copied into host memory.",
            stats.pages_prefetched,
        ),
        ("tier_prefetch_hits", "Prefetched host pages that admission then loaded.", stats.prefetch_hits),
    ):
        yield Figure(name, doc, "counter", samples=(("", value),))
    used = []
    if tiers.host is not None:
        used.append(("host", tiers.host.used_bytes))
    disk = tiers.disk
    if disk is not None:
        used.append(("disk", disk.used_bytes))
    yield Figure("tier_used_bytes", "Bytes each tier holds now.", "gauge", "tier", tuple(used))
    faults = []
    if disk is not None:
        seen = disk.stats
        for kind, value in (("corrupt", seen.corrupt), ("missing", seen.missing), ("unreadable", seen.unreadable)):
            faults.append((kind, value))
        faults.append(("write_error", disk.stats.write_errors))
    yield Figure("tier_disk_faults", "Disk tier pages dropped, by why.", "counter", "kind", tuple(faults))


def _latency(tiers: TierIndex) -> Figure:
    stats, running, buckets = tiers.stats, 0, []
    for bound, count in zip((*map(str, LOAD_BUCKETS_S), "+Inf"), list(stats.load_seconds)):
        running += count
        buckets.append((bound, float(running)))
    return Figure(
        "tier_load_seconds",
        "Fetching and verifying one continuation from the tiers.",
        "histogram",
        samples=tuple(buckets),
        total=stats.load_seconds_sum,
    )
