"""Tenant isolation over HTTP: namespaces derived from the API key or a trusted header, never the body."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.server.tenancy import read_key_file, salt_namespace, tenant_namespace
from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

KEYS = {"alice": "key-alice-1", "bob": "key-bob-2"}
ADMIN = "admin-key-3"
PROMPT = " ".join(f"w{i}" for i in range(20, 50))  # 30 tokens
PUBLIC = " ".join(f"w{i}" for i in range(60, 80))  # 20 tokens: the allowlisted public head


@pytest.fixture(scope="module")
def isolated(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    with ServerProcess(
        "--tenant-isolation",
        "--api-key-file",
        str(key_file),
        "--admin-api-key",
        ADMIN,
        "--shared-prefix",
        PUBLIC,
        "--log-level",
        "warning",
        model_path=tiny_model_dir,
    ) as proc:
        yield proc


def cached(
    url: str, key: str, salt: str | None = None, prompt: str = PROMPT, headers: dict[str, str] | None = None
) -> int:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(
        url + "/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {key}", **(headers or {})}
    )
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenants_never_share_and_each_still_hits_its_own(isolated: ServerProcess) -> None:
    prompt = PROMPT + " w90"
    assert cached(isolated.url, KEYS["alice"], prompt=prompt) == 0
    assert cached(isolated.url, KEYS["alice"], prompt=prompt) == 30  # paired: caching works
    assert cached(isolated.url, KEYS["bob"], prompt=prompt) == 0  # ... but not across tenants
    assert cached(isolated.url, KEYS["bob"], prompt=prompt) == 30


def test_a_client_salt_cannot_reach_another_tenant(isolated: ServerProcess) -> None:
    prompt = PROMPT + " w91"
    assert cached(isolated.url, KEYS["alice"], salt="shared", prompt=prompt) == 0
    assert cached(isolated.url, KEYS["alice"], salt="shared", prompt=prompt) == 30
    assert cached(isolated.url, KEYS["bob"], salt="shared", prompt=prompt) == 0  # same salt, other tenant
    assert cached(isolated.url, KEYS["alice"], salt="other", prompt=prompt) == 0  # salts split a tenant further
    for forged in (tenant_namespace("alice"), "alice", salt_namespace("shared") or ""):
        assert cached(isolated.url, KEYS["bob"], salt=forged, prompt=prompt) == 0


def test_an_allowlisted_public_head_is_shared_and_the_rest_stays_private(isolated: ServerProcess) -> None:
    prompt = PUBLIC + " w90 w91 w92"
    assert cached(isolated.url, KEYS["alice"], prompt=prompt) == 0
    assert cached(isolated.url, KEYS["bob"], prompt=prompt) == 20  # the public head only, not alice's question
    assert cached(isolated.url, KEYS["alice"], prompt=prompt) == 22  # paired: alice's private part is cached
    assert cached(isolated.url, KEYS["bob"], salt="mine", prompt=PUBLIC + " w93") == 20  # any salt shares the head


def test_cache_view_is_per_tenant_and_flush_is_admin_only(isolated: ServerProcess) -> None:
    secret = " ".join(f"w{i}" for i in range(100, 126))
    for _ in range(3):
        cached(isolated.url, KEYS["alice"], prompt=secret)

    def view(key: str) -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(isolated.url + "/cache", headers={"Authorization": f"Bearer {key}"}).json()
        return out

    alice, bob, admin = view(KEYS["alice"]), view(KEYS["bob"]), view(ADMIN)
    assert alice["namespace_view"] and "pool_tokens" not in alice and "free_tokens" not in bob
    assert any("w100" in p["head_text"] for p in alice["top_shared_prefixes"])
    assert not any("w100" in p["head_text"] for p in bob["top_shared_prefixes"])
    assert any("w100" in p["head_text"] for p in admin["top_shared_prefixes"]) and "pool_tokens" in admin
    assert alice["cached_tokens"] > 0 and admin["cached_tokens"] >= alice["cached_tokens"] + bob["cached_tokens"]
    refused = httpx.post(isolated.url + "/flush_cache", headers={"Authorization": f"Bearer {KEYS['bob']}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert httpx.post(isolated.url + "/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.post(isolated.url + "/v1/completions", json={"model": MODEL, "prompt": "w5"}).status_code == 401


def test_tenant_from_a_trusted_header(tiny_model_dir: Path) -> None:
    proc = ServerProcess(
        "--tenant-isolation", "--tenant-header", "X-Tenant", "--log-level", "warning", model_path=tiny_model_dir
    ).start()
    try:
        url = proc.url
        missing = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_tenant"
        assert cached(url, "unused", headers={"X-Tenant": "t1"}) == 0
        assert cached(url, "unused", headers={"X-Tenant": "t1"}) == 29  # all but the last prompt token
        assert cached(url, "unused", headers={"X-Tenant": "t2"}) == 0
    finally:
        proc.stop()


def test_namespaces_are_domain_separated_hashes() -> None:
    assert tenant_namespace("a") != tenant_namespace("a", "") != tenant_namespace("a", None)
    assert tenant_namespace("ab", "c") != tenant_namespace("a", "bc")  # length-prefixed parts
    assert salt_namespace("x") != tenant_namespace("x") and salt_namespace(None) is None
    assert "secret" not in (salt_namespace("secret") or "") + tenant_namespace("secret", "secret")


def test_key_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "keys"
    bad.write_text("alice key1\nbob\n")
    with pytest.raises(ValueError, match="keys:2"):
        read_key_file(bad)
    bad.write_text("alice key1\nbob key1\n")
    with pytest.raises(ValueError, match="twice"):
        read_key_file(bad)


@pytest.mark.parametrize("with_admin", [True, False])
def test_several_keys_without_isolation_cannot_read_or_flush_each_others_prompts(
    tiny_model_dir: Path, with_admin: bool
) -> None:
    """Keys without --tenant-isolation share the cache (B may hit A's prompt), but never its text or a flush."""
    admin = ("--admin-api-key", ADMIN) if with_admin else ()
    keys = ("--api-key", KEYS["alice"], "--api-key", KEYS["bob"])
    with ServerProcess(*keys, *admin, "--log-level", "warning", model_path=tiny_model_dir) as proc:
        secret = " ".join(f"w{i}" for i in range(100, 126))
        for end in ("w90", "w91"):  # a prefix shared by two prompts: /cache lists it
            cached(proc.url, KEYS["alice"], prompt=f"{secret} {end}")
        assert cached(proc.url, KEYS["bob"], prompt=f"{secret} w92") >= 26  # shared: what the README says

        def call(method: str, path: str, key: str) -> httpx.Response:
            return httpx.request(method, proc.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)

        for tenant in ("alice", "bob"):
            view = call("GET", "/cache", KEYS[tenant])
            assert view.status_code == 200 and view.json()["top_shared_prefixes"], view.text
            assert "w100" not in view.text and "head_text" not in view.text, view.text
            refused = call("POST", "/flush_cache", KEYS[tenant])
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        if with_admin:
            assert "w100" in call("GET", "/cache", ADMIN).text
            assert call("POST", "/flush_cache", ADMIN).status_code == 200


def test_a_single_key_is_the_operator(tiny_model_dir: Path) -> None:
    with ServerProcess("--api-key", KEYS["alice"], "--log-level", "warning", model_path=tiny_model_dir) as proc:
        for end in ("w90", "w91"):
            cached(proc.url, KEYS["alice"], prompt=f"{PROMPT} {end}")
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        assert "head_text" in httpx.get(proc.url + "/cache", headers=headers, timeout=30).text
        assert httpx.post(proc.url + "/flush_cache", headers=headers, timeout=30).status_code == 200


@pytest.mark.parametrize("policy", ["write_back"])  # write_through: test_tiers_restart.py's HTTP flush
def test_an_admin_flush_drops_tenants_kv_from_every_tier(tiny_model_dir: Path, tmp_path: Path, policy: str) -> None:
    """Under --tenant-isolation with a host tier and a cache directory, the admin's flush leaves no tenant's
    prefix in any tier: each tenant's next request computes it again."""
    key_file = tmp_path / "keys.txt"
    key_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    flags = ["--tenant-isolation", "--api-key-file", str(key_file), "--admin-api-key", ADMIN]
    flags += ["--hicache-size", "0.01", "--hicache-write-policy", policy, "--cache-dir", str(tmp_path / "kv")]
    prompt = " ".join(f"w{3 + (i * 7) % 120}" for i in range(80))  # five whole tier pages
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with ServerProcess(*flags, "--log-level", "warning", model_path=tiny_model_dir) as first:
        for key in KEYS.values():
            cached(first.url, key, prompt=prompt)
    with ServerProcess(*flags, "--log-level", "warning", model_path=tiny_model_dir) as proc:
        for key in KEYS.values():  # a warm restart: from disk into the pool (and the host tier)
            assert cached(proc.url, key, prompt=prompt) >= 64
        assert httpx.post(proc.url + "/flush_cache", headers=admin, timeout=30).status_code == 200
        view = httpx.get(proc.url + "/cache", headers=admin, timeout=30).json()
        assert view["tiers"]["host"]["pages"] == 0 and view["tiers"]["disk"]["pages"] == 0
        for key in KEYS.values():
            assert cached(proc.url, key, prompt=prompt) == 0
