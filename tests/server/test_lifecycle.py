"""Responsiveness, disconnects, API keys and shutdown, on a model slow enough to be caught mid-request.

The "medium" random model (4 layers, hidden 384, context 4,096) prefills ~2,000
tokens in about half a second on one CPU thread and decodes a few hundred
tokens a second: long enough for a client to act while a request runs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import assert_idle_and_conserved
from tests.support.server_process import ServerProcess
from tests.support.tiny_model import build_engine_folder

MEDIUM = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def medium_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_folder(tmp_path_factory.mktemp("models") / "medium", **MEDIUM)


@pytest.fixture(scope="module")
def medium(medium_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(
        "--enable-metrics", "--max-total-tokens", "16384", "--log-level", "warning", model_path=medium_dir
    ) as proc:
        yield proc


def aborted_count(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('radixserve:requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    raise AssertionError("no abort counter")


def test_health_and_metrics_answer_during_a_long_prefill(medium: ServerProcess) -> None:
    prompt = [3 + (i * 7) % 120 for i in range(4000)]  # one prefill step of 4,000 tokens
    done = threading.Event()
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["response"] = httpx.post(
            medium.url + "/generate", timeout=120, json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
        )
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    answered_during = 0
    with httpx.Client(timeout=30) as client:
        while not done.is_set():
            health = client.get(medium.url + "/health")
            metrics = client.get(medium.url + "/metrics")
            if not done.is_set() and health.status_code == 200 and metrics.status_code == 200:
                answered_during += 1
    thread.join()
    assert result["response"].status_code == 200 and result["response"].json()["meta_info"]["prompt_tokens"] == 4000
    # A blocked event loop would answer at most once or twice during the single prefill step.
    assert answered_during >= 5, answered_during


def test_client_disconnect_mid_stream_aborts_and_frees(medium: ServerProcess) -> None:
    aborted = aborted_count(medium.url)
    prompt = list(range(3, 103))
    with httpx.stream(
        "POST",
        medium.url + "/generate",
        timeout=60,
        json={"input_ids": prompt, "sampling_params": LONG, "stream": True},
    ) as response:
        lines = response.iter_lines()
        received = [event for event, _ in zip((line for line in lines if line.startswith("data: ")), range(5))]
        assert len(received) == 5
    # closed after 5 of 3,000 tokens: the server must notice, abort, unlock and free
    state = assert_idle_and_conserved(medium.url)
    assert aborted_count(medium.url) == aborted + 1
    assert state["cached_tokens"] == 0 or state["evictable_tokens"] == state["cached_tokens"]


def test_client_timeout_on_a_non_streaming_request_aborts_it(medium: ServerProcess) -> None:
    aborted = aborted_count(medium.url)
    body = {
        "model": "medium",
        "messages": [{"role": "user", "content": "w5 w6"}],
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(medium.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert_idle_and_conserved(medium.url)
    assert aborted_count(medium.url) == aborted + 1


def test_api_key_guards_everything_but_health_and_metrics(medium_dir: Path) -> None:
    proc = ServerProcess(
        "--api-key",
        "s3cret",
        "--enable-metrics",
        "--log-level",
        "warning",
        "--max-total-tokens",
        "4096",
        model_path=medium_dir,
    ).start()
    try:
        body = {"model": "medium", "prompt": "w5 w6", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.post(proc.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        for path in ("/cache", "/server_info", "/v1/models"):
            assert httpx.get(proc.url + path, timeout=30).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(proc.url + "/v1/completions", json=body, headers=good, timeout=60).status_code == 200
        assert (
            httpx.get(proc.url + "/health").status_code == 200 and httpx.get(proc.url + "/metrics").status_code == 200
        )
        info = httpx.get(proc.url + "/server_info", headers=good, timeout=30).json()
        assert info["server_args"]["api_keys"] == "<1 set>"  # never echoed back
        assert "s3cret" not in proc.log()
    finally:
        proc.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_or_aborts_in_flight_requests_and_exits_zero(medium_dir: Path, sig: int) -> None:
    proc = ServerProcess(
        "--graceful-shutdown-timeout", "1", "--log-level", "info", "--max-total-tokens", "4096", model_path=medium_dir
    ).start()
    events: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream(
                "POST",
                proc.url + "/generate",
                timeout=60,
                json={"input_ids": [5, 6, 7], "sampling_params": LONG, "stream": True},
            ) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))
        except httpx.HTTPError as exc:  # the connection closes when the server aborts the stream
            events.append(f"closed: {type(exc).__name__}")

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 30
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(events) >= 3, "the stream never started"
    code = proc.stop(sig, timeout=60)
    thread.join(30)
    assert code == 0, proc.log()
    assert len(events) < 3000  # it did not run to the end: it was aborted
    assert "server stopped" in proc.log()


def test_over_the_queue_limit_is_503_with_retry_after(medium_dir: Path) -> None:
    proc = ServerProcess(
        "--max-queued-requests", "1", "--log-level", "warning", "--max-total-tokens", "4096", model_path=medium_dir
    ).start()
    try:
        body = {"input_ids": [5, 6, 7], "sampling_params": LONG, "stream": True}
        with httpx.stream("POST", proc.url + "/generate", json=body, timeout=60) as first:
            lines = first.iter_lines()  # keep it referenced: a discarded iterator closes the connection
            next(line for line in lines if line.startswith("data: "))  # it is running
            second = httpx.post(proc.url + "/generate", json={**body, "stream": False}, timeout=60)
            assert second.status_code == 503 and second.headers["retry-after"] == "1"
            assert "in flight" in second.json()["error"]["message"]
        assert_idle_and_conserved(proc.url)  # the first was aborted by the disconnect: room again
        again = httpx.post(
            proc.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, timeout=60
        )
        assert again.status_code == 200
    finally:
        proc.stop()


def test_at_the_grace_limit_requests_get_a_503_and_streams_an_error_event_then_done(medium_dir: Path) -> None:
    proc = ServerProcess(
        "--graceful-shutdown-timeout", "2", "--log-level", "info", "--max-total-tokens", "8192", model_path=medium_dir
    ).start()
    answers: dict[str, Any] = {}
    events: list[str] = []

    def whole() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": LONG}
        response = httpx.post(proc.url + "/generate", json=body, timeout=120)
        answers["whole"] = (response.status_code, response.headers.get("retry-after"), response.json())

    def stream() -> None:
        body = {"model": "medium", "prompt": [5, 6, 8], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=120) as response:
            events.extend(line for line in response.iter_lines() if line.startswith("data: "))

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and httpx.get(proc.url + "/cache", timeout=30).json()["running_requests"] < 2:
        time.sleep(0.1)
    assert proc.stop(signal.SIGTERM, timeout=120) == 0, proc.log()
    for thread in threads:
        thread.join(60)
    status, retry_after, body = answers["whole"]
    assert status == 503 and body["error"]["code"] == "shutting_down" and retry_after == "1", body
    assert events[-1] == "data: [DONE]", events[-3:]
    assert "error" in events[-2] and "shutting down" in events[-2], events[-3:]
    assert "CancelledError" not in proc.log() and "Traceback" not in proc.log(), proc.log()[-3000:]
