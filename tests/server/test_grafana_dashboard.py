"""The shipped Grafana dashboards (examples/observability/): well-formed, and no dead panel.

Every metric and label a panel's PromQL names must be in a real server's ``/metrics``
after traffic that caches, evicts and loads from both tiers: a renamed metric fails
here, not on an operator's empty graph.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "observability"
DASHBOARDS = sorted((EXAMPLES / "grafana").glob("*.json"))
GRID_COLUMNS = 24
# Labels Prometheus adds to every scraped series (not in /metrics itself).
TARGET_LABELS = {"instance", "job"}
# Grafana's own variables; the dashboard's are checked against its templating list.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}

TARGET = {
    "type": "object",
    "required": ["refId", "expr", "datasource"],
    "properties": {"refId": {"type": "string", "pattern": "^[A-Z]$"}, "expr": {"type": "string", "minLength": 1}},
}
GRID = {
    "type": "object",
    "required": ["h", "w", "x", "y"],
    "properties": {k: {"type": "integer", "minimum": 0} for k in ("h", "w", "x", "y")},
}
PANEL = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"enum": ["row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap"]},
        "title": {"type": "string", "minLength": 1},
        "gridPos": GRID,
        "targets": {"type": "array", "items": TARGET},
        "fieldConfig": {"type": "object", "required": ["defaults", "overrides"]},
    },
}
# The part of Grafana's dashboard model (schemaVersion 39) these files use.
DASHBOARD = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "panels": {"type": "array", "minItems": 1, "items": PANEL},
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {"list": {"type": "array", "items": {"type": "object", "required": ["name", "type"]}}},
        },
        "time": {"type": "object", "required": ["from", "to"]},
    },
}


def load(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(path.read_text())
    return out


def queries(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            yield target["expr"]


def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["radixserve.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path: Path) -> None:
    dashboard = load(path)
    jsonschema.validate(dashboard, DASHBOARD)
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        cells = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"{panel['title']} queries nothing"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for source in (panel["datasource"], *(t["datasource"] for t in panel["targets"])):
            assert source == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    used = {name for expr in queries(dashboard) for name in re.findall(r"\$\{?(\w+)", expr)}
    assert used - GRAFANA_VARIABLES <= set(variables), used


def test_prometheus_config_scrapes_the_default_port() -> None:
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:30000"]


# ---- no dead panels: every query against a real server's /metrics --------------------------------------


def words(start: int, count: int) -> str:
    return " ".join(f"w{i % 90}" for i in range(start, start + count))


@pytest.fixture(scope="module")
def exposition(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Sample name -> its label names, after traffic that hits L1, evicts to L2 / L3 and loads back."""
    cache_dir = tmp_path_factory.mktemp("l3")
    flags = ("--enable-metrics", "--max-total-tokens", "512", "--page-size", "16", "--hicache-size", "0.001")
    with ServerProcess(*flags, "--cache-dir", str(cache_dir), "--log-level", "warning", model_path=tiny_model_dir) as s:
        body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True}
        cached = []
        for prompt in [words(0, 150), words(0, 150)] + [words(7 * i, 150) for i in range(1, 8)] + [words(0, 150)]:
            out = httpx.post(s.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=120).json()
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        text = httpx.get(s.url + "/metrics", timeout=30).text
    assert cached[1] > 0 and cached[-1] > 0, cached  # a pool hit, then a hit loaded back from a tier
    samples: dict[str, set[str]] = {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    assert totals["radixserve:evicted_tokens_total"] > 0 and totals["radixserve:tier_hit_tokens_total"] > 0, totals
    return samples


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_metrics_and_labels_the_server_exports(path: Path, exposition: dict[str, set[str]]) -> None:
    checked = 0
    for expr in queries(load(path)):
        names = re.findall(r"radixserve:[A-Za-z0-9_:]+", expr)
        assert names, f"no radixserve metric in {expr}"
        missing = [n for n in names if n not in exposition]
        assert not missing, f"{expr}: {missing} not in /metrics"
        labels = set().union(*(exposition[n] for n in names)) | TARGET_LABELS
        for group in re.findall(r"\b(?:by|on|group_left|group_right)\s*\(([^)]*)\)", expr):
            named = {label.strip() for label in group.split(",") if label.strip()}
            assert named <= labels, f"{expr}: labels {named - labels} not on {names}"
        for label in re.findall(r"[{,]\s*(\w+)\s*[=!]~?", expr):
            assert label in labels, f"{expr}: label {label} not on {names}"
        checked += 1
    assert checked >= 20
