"""Prometheus figures of the cache tiers (``--hicache-size`` / ``--cache-dir``), read at scrape time.

    radixserve:tier_hit_tokens_total{tier=host|disk}      prompt tokens loaded back instead of recomputed
    radixserve:tier_loaded_bytes_total{tier=host|disk}    K/V bytes copied back into the pool
    radixserve:tier_stored_bytes_total{tier=host|disk}    K/V bytes copied down
    radixserve:tier_load_seconds                          histogram: one continuation fetched and verified
    radixserve:tier_used_bytes{tier=host|disk}            what each tier holds now
    radixserve:tier_disk_faults_total{kind=corrupt|missing|write_error}

The scheduler thread owns the counters; a scrape reads plain ints (a value may
lag one step behind, never tear).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from radixserve.cache.tier_pages import LOAD_BUCKETS_S
from radixserve.cache.tiers import TierIndex

PREFIX = "radixserve:"


class TierCollector(Collector):
    def __init__(self, tiers: TierIndex) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Any]:
        stats = self.tiers.stats
        for name, doc, values in (
            ("tier_hit_tokens", "Prompt tokens loaded back from a tier.", stats.hit_tokens),
            ("tier_loaded_bytes", "K/V bytes loaded back into the pool.", stats.bytes_loaded),
            ("tier_stored_bytes", "K/V bytes copied down into a tier.", stats.bytes_stored),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["tier"])
            for tier, value in values.items():
                family.add_metric([tier], value)
            yield family
        yield self._latency()
        for name, doc, value in (
            (
                "tier_prefetched_pages",
                "Disk pages a queued request's prefetch copied into host memory.",
                stats.pages_prefetched,
            ),
            ("tier_prefetch_hits", "Prefetched host pages that admission then loaded.", stats.prefetch_hits),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        used = GaugeMetricFamily(PREFIX + "tier_used_bytes", "Bytes each tier holds now.", labels=["tier"])
        if self.tiers.host is not None:
            used.add_metric(["host"], self.tiers.host.used_bytes)
        disk = self.tiers.disk
        if disk is not None:
            used.add_metric(["disk"], disk.used_bytes)
        yield used
        faults = CounterMetricFamily(PREFIX + "tier_disk_faults", "Disk tier pages dropped, by why.", labels=["kind"])
        if disk is not None:
            for kind, value in (("corrupt", disk.stats.corrupt), ("missing", disk.stats.missing)):
                faults.add_metric([kind], value)
            faults.add_metric(["write_error"], disk.stats.write_errors)
        yield faults

    def _latency(self) -> HistogramMetricFamily:
        stats, running, buckets = self.tiers.stats, 0, []
        for bound, count in zip((*map(str, LOAD_BUCKETS_S), "+Inf"), list(stats.load_seconds)):
            running += count
            buckets.append((bound, running))
        return HistogramMetricFamily(
            PREFIX + "tier_load_seconds",
            "Fetching and verifying one continuation from the tiers.",
            buckets=buckets,
            sum_value=stats.load_seconds_sum,
        )
