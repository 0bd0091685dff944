"""GET /dashboard in a real headless browser: the system's chromium, driven by playwright (never a downloaded
browser). The server wants an API key: the page asks for it, then under traffic with a shared prefix the
figures move, the icicle shows the prefix on hover, the timeline fills, and the page logs no error but the
one 401 that made it ask; a screenshot lands in the test's temp folder."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: `make install` installs Debian's chromium where it can (root, apt)"
)
SHARED = " ".join(f"w{i}" for i in range(100, 124))  # 24 tokens every request starts with
KEY = "dashboard-key-1"  # the one key: its holder is the operator and may read prefix text
WAIT_MS = 60_000  # generous: the page polls every 1.5 s on a machine that may be busy


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A small pool over a host and a disk tier, so traffic evicts and every tier shows; an API key."""
    tiers = ("--hicache-size", "0.002", "--cache-dir", str(tmp_path_factory.mktemp("tiers")))
    flags = ("--max-total-tokens", "512", *tiers, "--api-key", KEY, "--log-level", "warning")
    with ServerProcess(*flags, model_path=tiny_model_dir) as proc:
        yield proc


def traffic(url: str, count: int, threads: int = 3) -> threading.Thread:
    """``count`` completions sharing SHARED (each its own tail), from ``threads`` clients; started."""

    def client(first: int) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
            for i in range(first, count, threads):
                tail = " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(12))
                body = {"model": MODEL, "prompt": f"{SHARED} {tail}", "max_tokens": 12, "ignore_eos": True}
                assert http.post(url + "/v1/completions", json=body).status_code == 200

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    runner = threading.Thread(target=lambda: [w.start() for w in workers] and [w.join() for w in workers])
    runner.start()
    return runner


# Where the first-row node with the most hits is drawn, in the viewport: [x, y] of its centre.
HOTTEST_CENTRE = """() => {
    const rects = [...document.querySelectorAll("#icicle rect[data-row='0']")];
    const hot = rects.reduce((a, b) => (Number(b.dataset.hits) > Number(a.dataset.hits) ? b : a));
    const box = hot.getBoundingClientRect();
    return [box.x + box.width / 2, box.y + box.height / 2];
}"""


def text_of(page: Page, selector: str) -> str:
    return page.text_content(selector) or ""


def wait_until(page: Page, script: str) -> None:
    page.wait_for_function(script, timeout=WAIT_MS, polling=100)


def test_the_dashboard_follows_traffic(server: ServerProcess, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1250})
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("#key-form", state="visible", timeout=WAIT_MS)  # /dashboard/data said 401
        assert "needs an API key" in text_of(page, "#status")
        assert len(errors) == 1 and "401" in errors[0], errors  # the browser logs the refused poll
        errors.clear()
        page.fill("#key", KEY)
        page.click("#key-form button[type=submit]")
        wait_until(page, "document.getElementById('status').textContent.startsWith('updated')")
        assert page.evaluate("sessionStorage.getItem('radixserve-api-key')") == KEY
        assert text_of(page, "#tokens-saved") == "0" and text_of(page, "#model") == "tiny-llama"

        load = traffic(server.url, 24)
        wait_until(page, "Number(document.getElementById('tokens-saved').dataset.value) >= 200")
        wait_until(page, "document.querySelectorAll('#timeline rect.phase.decode').length >= 10")
        load.join()
        before = text_of(page, "#tokens-saved")
        traffic(server.url, 6).join()
        wait_until(page, f"document.getElementById('tokens-saved').textContent !== {json.dumps(before)}")
        assert text_of(page, "#hit-rate-total").endswith("%") and text_of(page, "#tokens-per-s") != "-"
        # Each chart drew a line through values above zero: saved tokens, hit rate, tokens/s, the pool's
        # evictions (512 slots cannot hold the traffic), the tiers' traffic (what the pool evicted went down).
        for chart in ("saved", "hit-rate", "tps", "evictions", "traffic"):
            wait_until(page, f"Number(document.getElementById('chart-{chart}').dataset.max) > 0")
        tiers = text_of(page, "#tiers")
        assert "pool (L1)" in tiers and "host (L2)" in tiers and "disk (L3)" in tiers

        # The icicle: the shared prefix is the hottest first-row node; its head text shows on hover.
        hot = "#icicle rect[data-row='0']"
        wait_until(page, f'[...document.querySelectorAll("{hot}")].some(r => Number(r.dataset.hits) >= 10)')
        page.locator("#icicle").scroll_into_view_if_needed()
        page.mouse.move(*page.evaluate(HOTTEST_CENTRE))  # by position: a poll may redraw the icicle meanwhile
        wait_until(page, "document.getElementById('tooltip').textContent.includes('w100 w101 w102')")
        assert page.is_visible("#tooltip")
        tooltip = text_of(page, "#tooltip")
        assert "w100 w101 w102" in tooltip and "starting at token 0" in tooltip, tooltip
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        browser.close()
    assert errors == [], errors
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
