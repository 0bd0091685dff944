"""GET /dashboard and the JSON it polls, without a browser: shapes, counters that move, tenant isolation."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

KEYS = {"alice": "key-alice-1", "bob": "key-bob-2"}
ADMIN = "admin-key-3"
SHARED = " ".join(f"w{i}" for i in range(100, 124))  # 24 tokens every request starts with
SECRET = " ".join(f"w{i}" for i in range(40, 64))  # alice's prompt: bob must never read it


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(url: str, key: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "ignore_eos": True}  # sampled: EOS could end it early
    response = httpx.post(url + "/v1/completions", json=body, headers=bearer(key), timeout=60)
    assert response.status_code == 200, response.text


def data(url: str, key: str, tree: int = 100) -> dict[str, Any]:
    response = httpx.get(url + "/dashboard/data", params={"tree": tree}, headers=bearer(key), timeout=30)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def tree_nodes(view: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node the view's tree holds (the root excluded)."""
    out, stack = [], list(view["tree"]["root"]["children"])
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node["children"])
    return out


def texts(view: dict[str, Any]) -> str:
    return " | ".join(node.get("head_text", "") for node in tree_nodes(view))


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """Two keys sharing one cache (no isolation) and an admin key."""
    keys = ("--api-key", KEYS["alice"], "--api-key", KEYS["bob"], "--admin-api-key", ADMIN)
    with ServerProcess(*keys, "--log-level", "warning", model_path=tiny_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def isolated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    flags = ("--tenant-isolation", "--api-key-file", str(key_file), "--admin-api-key", ADMIN)
    with ServerProcess(*flags, "--log-level", "warning", model_path=tiny_model_dir) as proc:
        yield proc


def test_the_page_and_its_files_need_no_key_and_fetch_nothing_from_elsewhere(shared: ServerProcess) -> None:
    page = httpx.get(shared.url + "/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css"} <= set(assets)
    assert all(a.startswith("/dashboard/static/") or a.startswith("data:") for a in assets), assets
    for asset in assets:
        if asset.startswith("/"):
            served = httpx.get(shared.url + asset, timeout=30)
            assert served.status_code == 200 and "http" not in served.text.replace(SVG_NS, ""), asset
    assert httpx.get(shared.url + "/dashboard/static/dashboard.py", timeout=30).status_code == 404
    assert httpx.get(shared.url + "/dashboard/static/..%2Fapp.py", timeout=30).status_code == 404


SVG_NS = "http://www.w3.org/2000/svg"  # the one URL the script holds: a namespace name, never fetched


def test_data_needs_a_key_and_bounds_its_tree(shared: ServerProcess) -> None:
    assert httpx.get(shared.url + "/dashboard/data", timeout=30).status_code == 401
    assert httpx.get(shared.url + "/dashboard/data", headers=bearer("wrong"), timeout=30).status_code == 401
    too_big = httpx.get(shared.url + "/dashboard/data", params={"tree": 10**6}, headers=bearer(ADMIN), timeout=30)
    assert too_big.status_code == 400, too_big.text
    assert data(shared.url, ADMIN, tree=0)["tree"] is None  # no tree walk asked for


def test_counters_timeline_and_tree_follow_traffic(shared: ServerProcess) -> None:
    before = data(shared.url, ADMIN)
    for i in range(3):
        complete(shared.url, KEYS["alice"], f"{SHARED} w{10 + i} w{20 + i}")
    after = data(shared.url, ADMIN)
    grew = {name: after["totals"][name] - before["totals"][name] for name in ("prompt_tokens", "generated_tokens")}
    assert grew == {"prompt_tokens": 3 * 26, "generated_tokens": 9}, grew
    assert after["totals"]["cached_tokens"] - before["totals"]["cached_tokens"] >= 2 * 24  # the shared head
    assert after["time"] > before["time"] and after["load"] == {"running": 0, "waiting": 0, "token_usage": 0.0}
    pool = after["pool"]
    assert pool["free_tokens"] + pool["cached_tokens"] + pool["live_request_tokens"] == pool["pool_tokens"]
    assert after["evictions"][0] == {"tier": "device", "policy": "lru", "unit": "tokens", "evicted": 0}
    assert after["tiers"] is None and after["viewer"] == {"text": True, "namespaces": "all"}
    last = after["requests"][-3:]
    assert [r["prompt_tokens"] for r in last] == [26, 26, 26] and [r["output_tokens"] for r in last] == [3, 3, 3]
    for r in last:  # arrival, admission, first token, finish: in that order (seconds ago, so decreasing)
        assert r["arrival_ago_s"] >= r["admitted_ago_s"] >= r["first_token_ago_s"] >= r["finish_ago_s"] >= 0, r
    hot = max(tree_nodes(after), key=lambda node: node["hit_count"])
    assert hot["head_text"].startswith(SHARED) and hot["depth_tokens"] == 0 and len(hot["children"]) >= 2
    assert hot["subtree_tokens"] == hot["tokens"] + sum(child["subtree_tokens"] for child in hot["children"])


def test_without_isolation_only_the_admin_reads_prompt_text(shared: ServerProcess) -> None:
    complete(shared.url, KEYS["alice"], SECRET)
    bob, admin = data(shared.url, KEYS["bob"]), data(shared.url, ADMIN)
    assert "w40 w41" in texts(admin)
    assert bob["viewer"]["text"] is False and tree_nodes(bob)  # the shape, sizes and hits ...
    assert not any("head_text" in node or "head_token_ids" in node for node in tree_nodes(bob))  # ... never text


def test_under_isolation_a_tenant_sees_its_own_tree_and_requests_only(isolated: ServerProcess) -> None:
    for _ in range(2):
        complete(isolated.url, KEYS["alice"], SECRET)
    alice, bob, admin = (data(isolated.url, key) for key in (KEYS["alice"], KEYS["bob"], ADMIN))
    assert "w40 w41" in texts(alice) and "w40 w41" in texts(admin)
    assert alice["viewer"] == {"text": True, "namespaces": "own"} and len(alice["requests"]) == 2
    assert tree_nodes(bob) == [] and bob["requests"] == []  # nothing of alice's: no node, no timing
    assert admin["pool"]["cached_tokens"] >= alice["tree"]["root"]["subtree_tokens"] > 0
