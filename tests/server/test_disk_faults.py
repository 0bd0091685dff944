"""Fault scripts for the disk tier (issue 37, item 7): a server killed with SIGKILL while it writes pages, its
directory then damaged (a torn page, a directory in a page's place, a stray name), and a server restarted on it:
every request answers 200 with the text a cold run gives, and the damage is counted, not served."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

PROMPTS = [" ".join(f"w{3 + (i * k) % 120}" for i in range(64 + 8 * k)) for k in range(1, 13)]


def complete(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def test_a_server_killed_mid_write_and_a_damaged_directory_lose_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "kv"
    flags = ("--cache-dir", str(cache_dir), "--hicache-size", "0.01", "--hicache-write-policy", "write_through")
    first = ServerProcess(*flags, "--enable-metrics", model_path=tiny_model_dir).start()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(complete, first.url, prompt) for prompt in PROMPTS]
        deadline = time.monotonic() + 300
        # a request answered and 8 pages on disk (20 here when idle): two get damaged below, whole chains of the
        # rest must survive to be served (on a busy machine the writer can lag the first answer by whole pages)
        while time.monotonic() < deadline and not (
            any(p.done() for p in pending) and len(list((cache_dir / "pages").glob("*/*.kv"))) >= 8
        ):
            time.sleep(0.05)
        first.stop(signal.SIGKILL)  # mid-stream: pages queued for the writer, requests in flight
        for p in pending:
            try:
                p.result()
            except (httpx.HTTPError, AssertionError):
                pass  # the killed server's own requests may fail: only the restarted one is judged
    pages = sorted((cache_dir / "pages").glob("*/*.kv"))
    assert pages, "the killed server wrote no page"
    pages[0].write_bytes(pages[0].read_bytes()[:50])  # torn
    if len(pages) > 1:
        pages[1].unlink()
        pages[1].mkdir()  # a directory in a page's place
    stray = cache_dir / "pages" / "zz"
    stray.mkdir(exist_ok=True)
    (stray / ("z" * 32 + ".kv")).write_bytes(b"junk")

    with ServerProcess(*flags, "--enable-metrics", model_path=tiny_model_dir) as second:
        warm = [complete(second.url, prompt) for prompt in PROMPTS]
        assert httpx.get(second.url + "/health", timeout=60).status_code == 200
        faults = httpx.get(second.url + "/metrics", timeout=60).text
        cold = []
        for prompt in PROMPTS:  # each from an empty cache (the prompts share their first words)
            assert httpx.post(second.url + "/flush_cache", timeout=60).status_code == 200
            cold.append(complete(second.url, prompt))
    assert [a["choices"][0]["text"] for a in warm] == [c["choices"][0]["text"] for c in cold]
    disk_hits = re.search(r'^radixserve:tier_hit_tokens_total\{tier="disk"\} (\S+)$', faults, re.M)
    assert disk_hits is not None and float(disk_hits.group(1)) > 0  # the surviving pages were served
    assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for c in cold)
    assert 'tier_disk_faults_total{kind="unreadable"}' in faults
