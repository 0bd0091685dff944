"""Issue 13's defects, one regression test each: bad input is a 4xx that changes nothing, and
what can never succeed is refused before any work is done.

A second server here has a KV pool (128 tokens) smaller than the tiny model's context (256)
and a 64 KiB body limit, so both limits can be reached with small requests.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, assert_idle_and_conserved
from tests.support.server_process import ServerProcess, free_port

OK_COMPLETION = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
LONE = "a\ud800b"  # json.dumps writes it as the escape "\ud800": valid JSON, not text
MAX_BYTES = 65536


@pytest.fixture(scope="module")
def small_pool(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    flags = ("--max-total-tokens", "128", "--max-request-bytes", str(MAX_BYTES), "--log-level", "warning")
    with ServerProcess(*flags, model_path=tiny_model_dir) as proc:
        yield proc


def pipelined(url: str, path: str, body: bytes) -> tuple[list[bytes], bytes]:
    """POST ``body`` and GET /health on one keep-alive connection, sent together; (statuses, all bytes read)."""
    host, port = url.removeprefix("http://").split(":")
    post = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(post.encode() + body + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while not data.endswith(b'{"status":"ok"}'):
            chunk = sock.recv(65536)
            if not chunk:  # the server closed the connection
                break
            data += chunk
    return re.findall(rb"HTTP/1.1 (\d{3})", data), data


# ---- 1. a lone surrogate in any string: 400, and the connection still answers -------------------------

SURROGATE_CASES = [
    ("/v1/completions", {**OK_COMPLETION, "prompt": LONE}, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "model": "\ud800"}, "model"),
    ("/v1/chat/completions", {**OK_CHAT, "model": "\ud800"}, "model"),
    ("/v1/completions", {**OK_COMPLETION, "stop": [LONE]}, "stop[0]"),
    ("/v1/completions", {**OK_COMPLETION, "user": LONE}, "user"),
    ("/generate", {"text": LONE}, "text"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop": LONE}}, "sampling_params.stop"),
    ("/generate", {"input_ids": [5], "rid": LONE}, "rid"),
]


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES, ids=[f"{c[0]} {c[2]}" for c in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_lives(
    server: ServerProcess, path: str, body: dict[str, Any], field: str
) -> None:
    statuses, data = pipelined(server.url, path, json.dumps(body).encode())
    assert statuses == [b"400", b"200"], data.decode(errors="replace")
    assert f'"param": "{field}"' in data.decode() and "surrogate" in data.decode()
    assert_idle_and_conserved(server.url)


# ---- 2. a request the KV pool can never hold: 400 up front ----------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_beyond_the_kv_pool_is_refused_before_it_runs(small_pool: ServerProcess, stream: bool) -> None:
    body = {"model": MODEL, "prompt": [7] * 100, "max_tokens": 100, "ignore_eos": True, "stream": stream}
    response = httpx.post(small_pool.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_pool_exceeded" and "128" in error["message"] and "200" in error["message"]
    native = {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    assert httpx.post(small_pool.url + "/generate", json=native, timeout=60).status_code == 400
    assert_idle_and_conserved(small_pool.url)


def test_a_default_max_tokens_shrinks_to_what_the_pool_holds(small_pool: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": [7] * 100, "ignore_eos": True}  # the default: as much as fits
    response = httpx.post(small_pool.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    assert choice["finish_reason"] == "length" and 0 < usage["completion_tokens"] <= 28
    native = httpx.post(small_pool.url + "/generate", json={"input_ids": [7] * 100}, timeout=120)  # default 128
    assert native.status_code == 200 and "error" not in native.json()["meta_info"], native.text
    assert_idle_and_conserved(small_pool.url)


# ---- 3. size limits: 413 before parsing, over-long text refused before tokenizing ------------------------


def test_a_body_over_the_limit_is_413(small_pool: ServerProcess) -> None:
    big = json.dumps({**OK_COMPLETION, "prompt": "w5 " * MAX_BYTES}).encode()
    declared = httpx.post(small_pool.url + "/v1/completions", content=big, timeout=60)
    assert declared.status_code == 413 and "--max-request-bytes" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    chunked = httpx.post(small_pool.url + "/generate", content=chunks(), timeout=60)
    assert chunked.status_code == 413, chunked.text
    assert_idle_and_conserved(small_pool.url)


def test_text_longer_than_the_context_can_hold_is_refused_by_its_length(small_pool: ServerProcess) -> None:
    words = "w5 " * 20_000  # 60,000 characters, under the byte limit: 256 tokens x 16 characters is the bound
    for path, body in (
        ("/v1/completions", {**OK_COMPLETION, "prompt": words}),
        ("/generate", {"text": words}),
        ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": words}]}),
    ):
        response = httpx.post(small_pool.url + path, json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "60000 characters" in error["message"], error


# ---- 8. a port already in use fails before the model loads ------------------------------------------------


def test_a_port_in_use_fails_at_once_without_loading_the_model(tiny_model_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        port = busy.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "radixserve",
            "serve",
            "--model-path",
            str(tiny_model_dir),
            "--port",
            str(port),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "address already in use" in output.lower(), output
    assert "engine: " not in output, "the model was loaded first"


# ---- 9. smaller inconsistencies ---------------------------------------------------------------------------

NINE: list[tuple[str, str, Any, tuple[str, ...]]] = [
    ("/generate", {"input_ids": [5], "sampling_params": {"stop": [f"s{i}" for i in range(17)]}}, ("16", "stop")),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [-1]}}, ("stop_token_ids", "-1")),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [10**12]}}, ("stop_token_ids",)),
    ("/v1/completions", {**OK_COMPLETION, "stop_token_ids": [-1]}, ("stop_token_ids", "-1")),
    ("/v1/chat/completions", {**OK_CHAT, "stop_token_ids": [10**12]}, ("stop_token_ids",)),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}", ("deeper",)),
    ("/v1/completions", b'{"max_tokens": 1' + b"0" * 5000 + b"}", ("digits",)),
    ("/v1/completions", b"", ("empty",)),
    ("/generate", b"   ", ("empty",)),
]


@pytest.mark.parametrize("path,body,words", NINE, ids=[f"{c[0]} {str(c[1])[:40]}" for c in NINE])
def test_each_inconsistency_is_a_clear_400(server: ServerProcess, path: str, body: Any, words: tuple[str, ...]) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert not message.startswith(":") and "(UTF-8)" not in message, message
    for word in words:
        assert word in message, message
    assert_idle_and_conserved(server.url)
