"""Structured output over HTTP: OpenAI ``response_format`` on chat and completions, SGLang's json_schema /
regex / ebnf on /generate, streaming, and bad specs (400, nothing cached, nothing leaked)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import assert_idle_and_conserved, cache_state
from tests.support.server_process import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON."}]


@pytest.fixture(scope="module")
def server(byte_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("--max-total-tokens", "4096", "--log-level", "warning", model_path=byte_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def parse(text: str) -> Any:
    return json.loads(text)  # strict: a JSON string holds no raw control character


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_chat_json_schema_and_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny-byte-llama",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0.8,
        seed=5,
        response_format=json_schema_format(SCHEMA),  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(parse(choice.message.content or ""), SCHEMA)
    reply = client.chat.completions.create(
        model="tiny-byte-llama",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    # Any object: keys and strings are unbounded, so a random model may not close it in 40 tokens.
    choice = reply.choices[0]
    content = choice.message.content or ""
    assert content.startswith("{") and choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop":
        assert isinstance(parse(content), dict)


def test_completions_response_format(server: ServerProcess) -> None:
    body = {"model": "tiny-byte-llama", "prompt": "JSON: ", "max_tokens": 200, "temperature": 0}
    out = httpx.post(server.url + "/v1/completions", json={**body, "response_format": json_schema_format(SCHEMA)})
    assert out.status_code == 200, out.text
    jsonschema.validate(parse(out.json()["choices"][0]["text"]), SCHEMA)


def stream_chat(url: str, body: dict[str, Any]) -> tuple[str, str | None]:
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content", "")
                finish = choice["finish_reason"] or finish
    return text, finish


def test_streamed_constrained_text_equals_the_whole_answer(server: ServerProcess) -> None:
    body = {
        "model": "tiny-byte-llama",
        "messages": MESSAGES,
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 11,
        "response_format": json_schema_format(SCHEMA),
    }
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    streamed, finish = stream_chat(server.url, body)
    assert streamed == whole["message"]["content"] and finish == whole["finish_reason"] == "stop"
    jsonschema.validate(parse(streamed), SCHEMA)


def generate(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_generate_takes_sglang_constraints_and_sampling_fields(server: ServerProcess) -> None:
    frontend_defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "n": 1}
    frontend_defaults |= {"min_new_tokens": 0, "stop_regex": None, "json_schema": None, "stop_token_ids": None}
    cases = [
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(parse(t), SCHEMA) is None),
        ({"regex": r"(-)?(0|[1-9][0-9]*)"}, lambda t: re.fullmatch(r"(-)?(0|[1-9][0-9]*)", t)),
        ({"ebnf": 'root ::= "Paris" | "Rome"'}, lambda t: t in ("Paris", "Rome")),
    ]
    for constraint, check in cases:
        params = {**frontend_defaults, **constraint, "max_new_tokens": 120, "temperature": 0}
        out = generate(server.url, text="Answer: ", sampling_params=params)
        assert out.status_code == 200, out.text
        assert out.json()["meta_info"]["finish_reason"] == "stop" and check(out.json()["text"]), out.json()


def test_a_grammar_that_cannot_finish_ends_with_length(server: ServerProcess) -> None:
    out = generate(server.url, text="Go: ", sampling_params={"regex": "(ab){40}", "max_new_tokens": 6})
    assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"] == "length"
    assert out.json()["text"] == "ababab"


BAD = [
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{oops"}}, "json_schema", "invalid json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "[a-"}}, "regex", "invalid regex"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= nope"}}, "ebnf", 'Rule "nope" is not defined'),
    ("/generate", {"text": "x", "sampling_params": {"n": 2}}, "sampling_params", "n=2 is not supported"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": json_schema_format({"type": "object", "required": 5})},
        "json_schema",
        "invalid json_schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "needs json_schema.schema",
    ),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD)
def test_a_bad_spec_is_a_400_that_changes_nothing(
    server: ServerProcess, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    before = cache_state(server.url)
    if path.startswith("/v1"):
        body = {"model": "tiny-byte-llama", **body}
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    after = assert_idle_and_conserved(server.url)
    assert after["cached_tokens"] == before["cached_tokens"]
