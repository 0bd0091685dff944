"""A server restarted on its --cache-dir is warm for the same tenant and cold for another; tiers show in
/cache, /server_info and /metrics."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

DOC = " ".join(f"w{3 + (i * 7) % 120}" for i in range(80))  # 80 tokens: five whole tier pages


def complete(url: str, prompt: str, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def cached_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric(text: str, name: str, tier: str) -> float:
    match = re.search(rf'^radixserve:{name}{{tier="{tier}"}} (\S+)$', text, re.M)
    assert match is not None, f"{name}{{tier={tier}}} missing"
    return float(match.group(1))


def test_restart_is_warm_for_the_same_tenant_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = ("--cache-dir", str(tmp_path / "kv"), "--max-total-tokens", "512", "--enable-metrics")
    with ServerProcess(*flags, model_path=tiny_model_dir) as first:
        cold = complete(first.url, DOC + " w9")
        assert cached_tokens(cold) == 0
        assert cached_tokens(complete(first.url, DOC + " w9", salt="tenant-b")) == 0
    assert first.proc is not None and first.proc.returncode == 0
    assert "cache tiers closed" in first.log() and "flush timed out" not in first.log()

    with ServerProcess(*flags, model_path=tiny_model_dir) as second:
        assert "pages (" in second.log()  # the warm-restart index line
        warm = complete(second.url, DOC + " w9")
        assert cached_tokens(warm) >= 64 and warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert cached_tokens(complete(second.url, DOC + " w11", salt="tenant-c")) == 0
        view = httpx.get(second.url + "/cache", timeout=30).json()
        assert view["tiers"]["disk"]["pages"] >= 10 and view["tiers"]["disk"]["writable"]
        info = httpx.get(second.url + "/server_info", timeout=30).json()
        assert info["cache_tiers"]["hit_tokens"]["disk"] >= 64
        assert info["server_args"]["cache_dir"] == str(tmp_path / "kv")
        text = httpx.get(second.url + "/metrics", timeout=30).text
        assert metric(text, "tier_hit_tokens_total", "disk") >= 64
        assert metric(text, "tier_loaded_bytes_total", "disk") > 0
        assert "radixserve:tier_load_seconds_count" in text
        assert "radixserve:tier_prefetched_pages_total 0.0" in text  # no host tier: nothing to prefetch into


def test_a_second_server_on_the_directory_runs_read_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = ("--cache-dir", str(tmp_path / "kv"), "--max-total-tokens", "512")
    with ServerProcess(*flags, model_path=tiny_model_dir) as first:
        complete(first.url, DOC + " w9")
        with ServerProcess(*flags, model_path=tiny_model_dir) as second:
            assert "locked by another server" in second.log()
            assert httpx.get(second.url + "/cache", timeout=30).json()["tiers"]["disk"]["writable"] is False
            complete(second.url, DOC + " w9")  # serves all the same


def test_an_http_flush_empties_the_host_tier_too(tiny_model_dir: Path) -> None:
    """``POST /flush_cache`` is the engine's flush: after it the host tier serves nothing either."""
    flags = ("--hicache-size", "0.01", "--hicache-write-policy", "write_through", "--max-total-tokens", "512")
    with ServerProcess(*flags, model_path=tiny_model_dir) as server:
        assert cached_tokens(complete(server.url, DOC + " w9")) == 0
        assert httpx.get(server.url + "/cache", timeout=30).json()["tiers"]["host"]["pages"] > 0  # written through
        flushed = httpx.post(server.url + "/flush_cache", timeout=30)
        assert flushed.status_code == 200 and flushed.json()["dropped_tokens"] > 0
        assert httpx.get(server.url + "/cache", timeout=30).json()["tiers"]["host"]["pages"] == 0
        assert cached_tokens(complete(server.url, DOC + " w9")) == 0


# One policy over HTTP (the server runs Engine.flush_cache): tests/test_flush.py covers both on the engine itself,
# and the tenancy flush test runs write_back over HTTP.
@pytest.mark.parametrize("policy", ["write_through"])
def test_an_http_flush_empties_every_tier_and_a_restart_finds_nothing(
    tiny_model_dir: Path, tmp_path: Path, policy: str
) -> None:
    """With a host tier and a cache directory: sent, flushed, sent again -> nothing cached; the disk's page
    files are deleted, so the next server on the directory starts cold."""
    flags = ("--hicache-size", "0.01", "--hicache-write-policy", policy, "--cache-dir", str(tmp_path / "kv"))
    flags += ("--max-total-tokens", "512")
    with ServerProcess(*flags, model_path=tiny_model_dir) as first:
        complete(first.url, DOC + " w9")
    with ServerProcess(*flags, model_path=tiny_model_dir) as server:
        assert cached_tokens(complete(server.url, DOC + " w9")) >= 64  # from disk: all three tiers hold it now
        flushed = httpx.post(server.url + "/flush_cache", timeout=30)
        assert flushed.status_code == 200
        tiers = httpx.get(server.url + "/cache", timeout=30).json()["tiers"]
        assert tiers["host"]["pages"] == 0 and tiers["disk"]["pages"] == 0
        assert cached_tokens(complete(server.url, DOC + " w9")) == 0
        assert flushed.json()["tiers"] == ["device", "host", "disk"]
        assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    assert not list((tmp_path / "kv" / "pages").rglob("*.kv"))
    with ServerProcess(*flags, model_path=tiny_model_dir) as again:
        assert httpx.get(again.url + "/cache", timeout=30).json()["tiers"]["disk"]["pages"] == 0
        assert cached_tokens(complete(again.url, DOC + " w9")) == 0


def test_an_http_flush_takes_the_tiers_in_its_query_or_body(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = ("--hicache-size", "0.01", "--hicache-write-policy", "write_through", "--cache-dir", str(tmp_path / "kv"))
    with ServerProcess(*flags, "--max-total-tokens", "512", model_path=tiny_model_dir) as server:
        complete(server.url, DOC + " w9")
        for bad in ({"params": {"tiers": "device,gpu"}}, {"json": {"tiers": "device"}}, {"json": {"tier": ["disk"]}}):
            refused = httpx.post(server.url + "/flush_cache", timeout=30, **bad)  # type: ignore[arg-type]
            assert refused.status_code == 400, refused.text
        assert cached_tokens(complete(server.url, DOC + " w9")) >= 64  # a refused flush dropped nothing
        kept = httpx.post(server.url + "/flush_cache", params={"tiers": "device,host"}, timeout=30)
        assert kept.status_code == 200 and kept.json()["tiers"] == ["device", "host"]
        assert cached_tokens(complete(server.url, DOC + " w9")) >= 64  # the disk still serves it
        disk = httpx.post(server.url + "/flush_cache", json={"tiers": ["device", "host", "disk"]}, timeout=30)
        assert disk.status_code == 200 and disk.json()["tiers"] == ["device", "host", "disk"]
        assert cached_tokens(complete(server.url, DOC + " w9")) == 0
