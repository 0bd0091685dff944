"""Reasoning output, /tokenize and /v1/embeddings against a live server, driven by the official ``openai`` client.

The byte-level tiny model can spell anything, so SGLang's ``regex`` extension forces an exact answer with a
``<think>`` block: the parser's split is then deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import assert_idle_and_conserved
from tests.support.server_process import ServerProcess

MODEL = "tiny-byte-llama"
FORCED = "<think>\nadd them\n</think>\n\nfour"


@pytest.fixture(scope="module")
def server(byte_model_dir: Path) -> Iterator[ServerProcess]:
    flags = ("--max-total-tokens", "4096", "--log-level", "warning", "--reasoning-parser", "qwen3")
    with ServerProcess(*flags, model_path=byte_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, regex: str, extra: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "2 + 2?"}]
    body = {"regex": regex, **(extra or {})}
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, extra_body=body, **kwargs
    )


def test_reasoning_goes_into_reasoning_content(client: openai.OpenAI, server: ServerProcess) -> None:
    out = chat(client, FORCED)
    message = out.choices[0].message
    assert message.content == "four" and message.model_extra is not None
    assert message.model_extra["reasoning_content"] == "add them"
    assert out.choices[0].finish_reason == "stop"
    assert_idle_and_conserved(server.url)


def test_streamed_reasoning_deltas_assemble_to_the_same_fields(client: openai.OpenAI) -> None:
    reasoning: dict[int, list[str]] = {0: [], 1: []}
    content: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chat(client, FORCED, stream=True, n=2, seed=3):  # each choice has its own parser state
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning[choice.index].append(extra.get("reasoning_content") or "")
            content[choice.index].append(choice.delta.content or "")
    for index in (0, 1):
        assert "".join(reasoning[index]) == "add them" and "".join(content[index]) == "four"
        assert sum(bool(r) for r in reasoning[index]) >= 2, "reasoning streams as it is made, not at the end"


def test_separate_reasoning_false_returns_the_raw_text(client: openai.OpenAI) -> None:
    out = chat(client, FORCED, {"separate_reasoning": False})
    assert out.choices[0].message.content == FORCED
    assert "reasoning_content" not in (out.choices[0].message.model_extra or {})


def test_completions_take_the_regex_extension_too(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=20, extra_body={"regex": "<think>[a-c]{3}"})
    text = out.choices[0].text
    assert text.startswith("<think>") and len(text) == 10 and set(text[7:]) <= set("abc")


def test_unterminated_and_absent_blocks(client: openai.OpenAI) -> None:
    cut = chat(client, "<think>\nstill going")
    assert cut.choices[0].message.content is None
    assert (cut.choices[0].message.model_extra or {})["reasoning_content"] == "still going"
    plain = chat(client, "just four")
    assert plain.choices[0].message.content == "just four"
    assert (plain.choices[0].message.model_extra or {})["reasoning_content"] is None


def test_response_format_is_enforced_after_the_reasoning(client: openai.OpenAI, server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    choice = out.choices[0]
    reasoning = (choice.message.model_extra or {})["reasoning_content"]
    if choice.finish_reason == "stop":  # the grammar ended: the content after any reasoning is the schema's JSON
        assert isinstance(json.loads(choice.message.content or ""), dict)
        assert "n" in json.loads(choice.message.content or "")
    else:  # cut inside the reasoning block: no content yet, never a half-parsed one
        assert choice.finish_reason == "length" and reasoning is not None
    both = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "regex": "a",
            "response_format": {"type": "json_object"},
        },
        timeout=60,
    )
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_round_trip_and_chat_messages(server: ServerProcess, client: openai.OpenAI) -> None:
    text = "hello <think> world"
    for path in ("/tokenize", "/v1/tokenize"):
        got = post(server, path, {"model": MODEL, "prompt": text}).json()
        assert got["count"] == len(got["tokens"]) == len(text.encode()) and got["max_model_len"] > 0
        back = post(server, path.replace("tokenize", "detokenize"), {"tokens": got["tokens"]}).json()
        assert back["prompt"] == back["text"] == text
    messages = [{"role": "user", "content": "2 + 2?"}]
    counted = post(server, "/tokenize", {"messages": messages}).json()
    answer = chat(client, "four")
    assert answer.usage is not None and counted["count"] == answer.usage.prompt_tokens


def embed(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.embeddings.create(model=MODEL, **kwargs)


def vectors(response: Any) -> np.ndarray:
    return np.asarray([d.embedding for d in response.data], dtype=np.float32)


def test_embeddings_float_base64_lists_and_token_arrays(client: openai.OpenAI, server: ServerProcess) -> None:
    texts = ["the sky is blue", "a cat sat on the mat"]
    floats = vectors(embed(client, input=texts, encoding_format="float"))
    decoded = vectors(embed(client, input=texts))  # the client asks for base64 and decodes it
    assert floats.shape == (2, 64) and np.allclose(np.linalg.norm(floats, axis=1), 1, atol=1e-5)
    assert np.allclose(floats, decoded, atol=1e-5)
    assert not np.allclose(floats[0], floats[1], atol=1e-3)
    raw = post(server, "/v1/embeddings", {"model": MODEL, "input": texts[0], "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    ids = post(server, "/tokenize", {"prompt": texts[1]}).json()["tokens"]
    by_ids = embed(client, input=[ids], encoding_format="float")
    assert np.allclose(vectors(by_ids)[0], floats[1], atol=1e-4)
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.data[0].index == 0
    assert_idle_and_conserved(server.url)


def test_a_cached_prefix_is_not_recomputed_and_gives_the_same_embedding(client: openai.OpenAI) -> None:
    prefix = "shared system prompt for every embedding call, " * 3
    cold = embed(client, input=prefix + "first question", encoding_format="float")
    hit = embed(client, input=prefix + "second one", encoding_format="float")
    again = embed(client, input=prefix + "first question", encoding_format="float")
    for response in (cold, hit, again):
        assert response.usage.model_extra is not None
    assert cold.usage.model_extra["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit.usage.model_extra["prompt_tokens_details"]["cached_tokens"] >= len(prefix.encode())
    # everything but the last token came from the cache, and the result is the cold one's
    assert again.usage.model_extra["prompt_tokens_details"]["cached_tokens"] == cold.usage.prompt_tokens - 1
    assert np.allclose(vectors(again), vectors(cold), atol=1e-4)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"input": ""}, 400, "empty"),
        ({"input": []}, 400, "empty"),
        ({"input": [[]]}, 400, "empty"),
        ({"input": [5, 999]}, 400, "token ids must be in"),
        ({"input": "x", "dimensions": 16}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "model": "other"}, 404, "does not exist"),
    ],
)
def test_bad_embedding_input_is_a_400_and_leaves_nothing_behind(
    server: ServerProcess, body: dict[str, Any], status: int, says: str
) -> None:
    response = post(server, "/v1/embeddings", {"model": MODEL, **body})
    assert response.status_code == status and says in response.json()["error"]["message"], response.text
    assert_idle_and_conserved(server.url)


def test_dimensions_equal_to_the_hidden_size_is_accepted(client: openai.OpenAI) -> None:
    assert len(embed(client, input="x", dimensions=64, encoding_format="float").data[0].embedding) == 64


def test_bad_tokenize_input_is_a_400(server: ServerProcess) -> None:
    assert post(server, "/detokenize", {"tokens": [3, 100000]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    assert post(server, "/tokenize", {"prompt": "x", "add_special_token": True}).status_code == 400  # a typo
