"""One tiny-model server for the module's tests (a child process, as users run it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_process import ServerProcess

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(
        "--enable-metrics", "--max-total-tokens", "4096", "--log-level", "warning", model_path=tiny_model_dir
    ) as proc:
        yield proc


def cache_state(url: str, **headers: str) -> dict[str, Any]:
    """The server's /cache summary with the invariant check on."""
    out: dict[str, Any] = httpx.get(url + "/cache", params={"check": "true"}, headers=headers, timeout=30).json()
    return out


def assert_idle_and_conserved(url: str, **headers: str) -> dict[str, Any]:
    """Nothing in flight, no lock held, every slot free or cached, the tree consistent."""
    import time

    deadline = time.monotonic() + 10
    state = cache_state(url, **headers)
    while (state["running_requests"] or state["waiting_requests"]) and time.monotonic() < deadline:
        time.sleep(0.05)  # an abort is processed on the scheduler's next turn
        state = cache_state(url, **headers)
    assert state["running_requests"] == state["waiting_requests"] == 0, state
    assert state["protected_tokens"] == 0, f"a lock is still held: {state}"
    assert state["live_request_tokens"] == 0, f"slots leaked: {state}"
    assert state["free_tokens"] + state["cached_tokens"] == state["pool_tokens"], state
    assert state["invariants"] == "ok", state
    return state
