"""Bad input: an OpenAI-style error JSON with a 4xx, and nothing changes (no slot, no lock, no node)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, assert_idle_and_conserved
from tests.support.server_process import ServerProcess

OK_COMPLETION = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
TOO_LONG = " ".join(["w7"] * 300)  # the tiny model's context is 256

# (name, method, path, body (dict -> JSON, bytes -> raw), expected status, words the message must contain)
CASES: list[tuple[str, str, str, Any, int, tuple[str, ...]]] = [
    ("malformed JSON", "POST", "/v1/completions", b'{"model": "tiny', 400, ("JSON",)),
    ("invalid UTF-8", "POST", "/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}', 400, ("JSON",)),
    ("body is a list", "POST", "/v1/completions", b"[1, 2]", 400, ()),
    ("max_tokens as a string", "POST", "/v1/completions", {**OK_COMPLETION, "max_tokens": "5"}, 400, ("max_tokens",)),
    ("n as a bool", "POST", "/v1/completions", {**OK_COMPLETION, "n": True}, 400, ("n",)),
    ("messages not a list", "POST", "/v1/chat/completions", {**OK_CHAT, "messages": "hi"}, 400, ("messages",)),
    (
        "bad role",
        "POST",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "x", "content": "w5"}]},
        400,
        ("role",),
    ),
    ("negative max_tokens", "POST", "/v1/completions", {**OK_COMPLETION, "max_tokens": -1}, 400, ("max_tokens",)),
    (
        "absurd max_tokens",
        "POST",
        "/v1/completions",
        {**OK_COMPLETION, "max_tokens": 10**9},
        400,
        ("256", "1000000002", "2 in the prompt"),
    ),
    (
        "prompt beyond the context",
        "POST",
        "/v1/completions",
        {**OK_COMPLETION, "prompt": TOO_LONG},
        400,
        ("256", "300"),
    ),
    (
        "chat beyond the context",
        "POST",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": TOO_LONG}]},
        400,
        ("256", "302"),
    ),
    ("empty prompt", "POST", "/v1/completions", {**OK_COMPLETION, "prompt": ""}, 400, ("empty",)),
    ("empty token prompt", "POST", "/v1/completions", {**OK_COMPLETION, "prompt": []}, 400, ("empty",)),
    ("no messages", "POST", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, ("messages",)),
    ("unknown model", "POST", "/v1/completions", {**OK_COMPLETION, "model": "gpt-9"}, 404, ("gpt-9", MODEL)),
    ("token id beyond the vocabulary", "POST", "/v1/completions", {**OK_COMPLETION, "prompt": [5, 999]}, 400, ("128",)),
    ("temperature out of range", "POST", "/v1/completions", {**OK_COMPLETION, "temperature": 5}, 400, ("temperature",)),
    ("top_p zero", "POST", "/v1/chat/completions", {**OK_CHAT, "top_p": 0}, 400, ("top_p",)),
    ("n zero", "POST", "/v1/completions", {**OK_COMPLETION, "n": 0}, 400, ("n",)),
    ("logit_bias", "POST", "/v1/completions", {**OK_COMPLETION, "logit_bias": {"5": 10}}, 400, ("logit_bias",)),
    (
        "tool without a function",
        "POST",
        "/v1/chat/completions",
        {**OK_CHAT, "tools": [{"type": "function"}]},
        400,
        ("tools.0.function",),
    ),
    (
        "image content",
        "POST",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        ("image_url",),
    ),
    (
        "yaml response_format",
        "POST",
        "/v1/chat/completions",
        {**OK_CHAT, "response_format": {"type": "yaml"}},
        400,
        ("response_format",),
    ),
    (
        "too many top_logprobs",
        "POST",
        "/v1/chat/completions",
        {**OK_CHAT, "logprobs": True, "top_logprobs": 50},
        400,
        ("top_logprobs",),
    ),
    ("native: text and input_ids", "POST", "/generate", {"text": "w5", "input_ids": [5]}, 400, ("exactly one",)),
    (
        "native: unknown sampling param",
        "POST",
        "/generate",
        {"text": "w5", "sampling_params": {"temprature": 0}},
        400,
        ("temprature",),
    ),
    ("native: unknown field", "POST", "/generate", {"text": "w5", "max_tokens": 3}, 400, ("max_tokens",)),
    ("native: empty input_ids", "POST", "/generate", {"input_ids": []}, 400, ("empty",)),
    (
        "native: bad sampling value",
        "POST",
        "/generate",
        {"text": "w5", "sampling_params": {"top_k": 0}},
        400,
        ("top_k",),
    ),
    (
        "native: params count",
        "POST",
        "/generate",
        {"text": ["w5", "w6"], "sampling_params": [{}]},
        400,
        ("1 sampling",),
    ),
    ("GET on a POST endpoint", "GET", "/v1/completions", None, 405, ()),
    ("unknown path", "GET", "/v2/nothing", None, 404, ()),
    ("cache: top out of range", "GET", "/cache?top=1000", None, 400, ("top",)),
]


@pytest.mark.parametrize("name,method,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_error_and_changes_nothing(
    server: ServerProcess, name: str, method: str, path: str, body: Any, status: int, words: tuple[str, ...]
) -> None:
    before = assert_idle_and_conserved(server.url)
    kwargs: dict[str, Any] = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else ({"json": body} if body is not None else {})
    )
    response = httpx.request(method, server.url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    for word in words:
        assert word in error["message"], error["message"]
    after = assert_idle_and_conserved(server.url)
    for key in ("cached_tokens", "free_tokens", "nodes"):
        assert after[key] == before[key], (key, before, after)


def test_the_server_still_serves_after_bad_input(server: ServerProcess) -> None:
    response = httpx.post(server.url + "/v1/completions", json=OK_COMPLETION, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
