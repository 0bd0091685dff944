"""SGLang frontend programs and structured output on the real embedded model (slow: loads SmolLM2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import sglang as sgl

from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-total-tokens", "4096").start(timeout=300)
    yield proc
    assert proc.stop() == 0, proc.log()


@sgl.function
def capital(s: Any) -> None:
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant("The capital of France is" + sgl.select("city", choices=[" London", " Paris", " Berlin"]))
    s += sgl.user("And its population, roughly?")
    s += sgl.assistant(sgl.gen("population", max_tokens=24, temperature=0))


def test_select_and_multi_turn_on_smollm2(smollm2: ServerProcess) -> None:
    # SGLang picks a template by model path; SmolLM2's is ChatML (its name does not say so)
    backend = sgl.RuntimeEndpoint(smollm2.url, chat_template_name="chatml")
    state = capital.run(backend=backend)
    assert state["city"] == " Paris"
    meta = state.get_meta_info("population")
    assert state["population"] and meta["cached_tokens"] > 20  # the whole first exchange, from select's requests


def test_json_schema_on_smollm2(smollm2: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    client = openai.OpenAI(base_url=smollm2.url + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "Give the capital of France and its country as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
    )
    data = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(data, schema)
    assert reply.choices[0].finish_reason == "stop" and "Paris" in data["city"]
