"""Each tool-call format end to end: a forced call in the template's own format (Llama 3's JSON with Llama 3.2's
template, Mistral's ``[TOOL_CALLS]`` with Mistral Nemo's), and the Hermes fallback block of a template without
tools; each call answered with a tool result on the next turn. The model is the tiny byte-level Llama with a 4k
context (the GGUF fixtures' 512 tokens do not hold Llama 3.2's tools prompt in their 1k-token BPE)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.server_process import ServerProcess
from tests.support.tiny_model import build_byte_engine_folder

TEMPLATES = Path(__file__).parents[1] / "fixtures/templates"
SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}}]
# (chat template or None for the model's own, how a call id looks, a text only its format writes)
CASES = {
    "llama3_json": ("llama3.2-tools.jinja", "call_", '"parameters"'),
    "mistral": ("mistral-nemo-tools.jinja", "", "[TOOL_CALLS]"),
    "fallback": (None, "call_", "<tool_response>"),
}


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_byte_engine_folder(tmp_path_factory.mktemp("models") / "byte-4k", max_position_embeddings=4096)


def post(url: str, **body: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 80, "temperature": 0, "tools": TOOLS, **body}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


@pytest.mark.parametrize("case", CASES)
def test_forced_call_and_its_result(case: str, byte_folder: Path) -> None:
    template, id_prefix, marker = CASES[case]
    path = byte_folder
    flags = ["--served-model-name", "m", "--log-level", "warning", "--max-total-tokens", "8192"]
    flags += ["--chat-template", str(TEMPLATES / template)] if template else []
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What time is it?"}]
    with ServerProcess(*flags, model_path=path) as server:
        reply = post(server.url, messages=messages, tool_choice="required", parallel_tool_calls=False)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_time" and call["id"].startswith(id_prefix)
        if case == "mistral":
            assert len(call["id"]) == 9 and call["id"].isalnum()  # what Mistral's template accepts back
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
        messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
        second = post(server.url, messages=messages, tool_choice="none", max_tokens=2)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= reply["usage"]["prompt_tokens"]
        info = httpx.get(server.url + "/server_info", timeout=60).json()["tool_calls"]
        assert info == {
            "parser": "hermes" if case == "fallback" else case,
            "template_renders_tools": case != "fallback",
            "fallback_block": case == "fallback",
        }
        if case == "mistral":  # the tiny model writes several calls in Mistral's list when it may
            check_parallel_calls(server.url)
        if case == "llama3_json":  # JSON that is not a call (response_format makes the model write one): content
            answer = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
            form = {"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}
            plain = post(server.url, messages=messages[:1], tool_choice="auto", response_format=form)["choices"][0]
            assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"], plain
            assert list(json.loads(plain["message"]["content"])) == ["answer"]
    check_rendered_prompt(path, template, messages, marker)


# An answer that thinks, then calls (Hermes form): SGLang's regex extension spells it out for the random model.
THINK_THEN_CALL = (
    r"<think>\nWhich zone\?\n</think>\n\n"
    r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\n</tool_call>'
)


def test_calls_are_read_after_the_reasoning(byte_folder: Path) -> None:
    """With --reasoning-parser, the reasoning goes to reasoning_content and the call after it to tool_calls, whole
    and streamed (as the openai client assembles it)."""
    flags = ["--served-model-name", "m", "--log-level", "warning", "--reasoning-parser", "qwen3"]
    messages = [{"role": "user", "content": "What time is it?"}]
    with ServerProcess(*flags, model_path=byte_folder) as server:
        whole = post(server.url, messages=messages, tool_choice="auto", regex=THINK_THEN_CALL, max_tokens=200)
        whole = whole["choices"][0]
        assert whole["finish_reason"] == "tool_calls", whole
        assert whole["message"]["reasoning_content"] == "Which zone?"
        [call] = whole["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_time", {"zone": "CET"})
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,
            max_tokens=200,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            extra_body={"regex": THINK_THEN_CALL},
        )
        reasoning, name, arguments, finish = "", "", "", None
        for chunk in stream:
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                for piece in choice.delta.tool_calls or []:
                    name += (piece.function.name or "") if piece.function else ""
                    arguments += (piece.function.arguments or "") if piece.function else ""
                finish = choice.finish_reason or finish
        assert (reasoning, name, json.loads(arguments), finish) == (
            "Which zone?",
            "get_time",
            {"zone": "CET"},
            "tool_calls",
        )


def check_parallel_calls(url: str) -> None:
    """Parallel calls, whole and streamed (seeded: the same answers), as the openai client assembles them. Seed 0
    gives two calls in choice 0 and both choices end (the client's stream helper raises on a cut one)."""
    question = [{"role": "user", "content": "What time is it?"}]
    body: dict[str, Any] = dict(messages=question, tool_choice="required", temperature=1.0, seed=0, n=2)
    whole = post(url, **body, max_tokens=300)["choices"]
    calls = [
        [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"].get("tool_calls") or []]
        for ch in whole
    ]
    assert max(len(c) for c in calls) >= 2, calls
    for choice_calls in calls:
        for _, arguments in choice_calls:
            jsonschema.validate(json.loads(arguments), SCHEMA)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    with client.chat.completions.stream(model="m", tools=TOOLS, max_tokens=300, **body) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_completion().choices
    assert [[(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []] for ch in streamed] == calls
    assert [ch.finish_reason for ch in streamed] == [ch["finish_reason"] for ch in whole]


def check_rendered_prompt(path: Path, template: str | None, messages: list[dict[str, Any]], marker: str) -> None:
    """The history as the server renders it carries the call in the model's format (not dropped)."""
    from radixserve.model.tokenizer import Tokenizer
    from radixserve.server.protocol import ChatCompletionRequest
    from radixserve.server.tools import plan_tools, render_kwargs, template_messages

    tokenizer = Tokenizer.from_model_path(path)
    if template:
        tokenizer = tokenizer.with_chat_template(TEMPLATES / template)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": TOOLS})
    plan = plan_tools(body, None, tokenizer.chat_template)
    assert plan is not None and plan.native == (template is not None)
    text = tokenizer.render_chat(template_messages(body, plan), **render_kwargs(plan))
    assert marker in text and '"get_time"' in text and "12:00" in text, text
