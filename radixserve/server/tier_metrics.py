"""Prometheus families of the cache tiers (``--hicache-size`` / ``--cache-dir``), read at scrape time.

Which figures there are, and what each counts, is the tiers' own (cache/tiers/metrics.py,
plain data); this adapter only renders them, so the cache layer never imports prometheus.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.metrics import Figure, tier_figures

PREFIX = "radixserve:"


class TierCollector(Collector):
    def __init__(self, tiers: TierIndex) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        return (family(figure) for figure in tier_figures(self.tiers))


def family(figure: Figure) -> Metric:
    """``figure`` as the Prometheus family of its kind."""
    name = PREFIX + figure.name
    if figure.kind == "histogram":
        return HistogramMetricFamily(name, figure.doc, buckets=list(figure.samples), sum_value=figure.total)
    kind = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
    if not figure.label:
        return kind(name, figure.doc, value=figure.samples[0][1])
    out = kind(name, figure.doc, labels=[figure.label])
    for label_value, value in figure.samples:
        out.add_metric([label_value], value)
    return out
