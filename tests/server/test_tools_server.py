"""Tool calling over HTTP with real clients: the openai client (whole and streamed, every tool_choice, tool results,
parallel calls in the history), three agent frameworks (openai-agents, langchain-openai, pydantic-ai) driving a
tool loop unchanged, the prefix an agent's turns share, and bad tool input (400, nothing left running).

One server: the tiny byte-level model (any text encodes) with Qwen 2.5's chat template (Hermes calls). A random
model calls nothing on its own, so each loop forces its call with tool_choice: the grammar makes that call
valid, and the test checks that it arrives parsed and that the tool's result goes back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import assert_idle_and_conserved
from tests.support.server_process import ServerProcess
from tests.support.tiny_model import build_byte_engine_folder

TEMPLATE = Path(__file__).parents[1] / "fixtures/templates/qwen2.5-tools.jinja"
MODEL = "tiny-byte-4k"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
QUESTION: list[Any] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Rome?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = build_byte_engine_folder(tmp_path_factory.mktemp("models") / MODEL, max_position_embeddings=4096)
    flags = ("--chat-template", str(TEMPLATE), "--max-total-tokens", "16384", "--log-level", "warning")
    with ServerProcess(*flags, model_path=folder) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 160, "temperature": 0, **fields}
    return client.chat.completions.create(**body)


def check_calls(message: Any, names: set[str]) -> list[Any]:
    """The message's calls: each of a tool in ``names``, its arguments valid against that tool's schema."""
    calls = message.tool_calls or []
    assert calls and not message.content  # None whole; "" streamed (the first chunk opens the content)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_required_and_named_calls(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = chat(client, tool_choice="required", temperature=1.0, seed=seed)
        assert reply.choices[0].finish_reason == "tool_calls"
        check_calls(reply.choices[0].message, set(SCHEMAS))
    named = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in check_calls(named.choices[0].message, {"get_time"})] == ["get_time"]


def test_streamed_calls_assemble_as_the_whole_answer(client: openai.OpenAI) -> None:
    whole = chat(client, tool_choice="required").choices[0].message
    chunks = list(chat(client, tool_choice="required", stream=True))
    tool_deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first, rest = tool_deltas[0], tool_deltas[1:]
    assert first.id and first.function.name and first.function.arguments == ""  # id and name first
    assert len(rest) > 1 and all(d.id is None and d.function.name is None for d in rest)  # then argument fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0
    ) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in check_calls(streamed, set(SCHEMAS))] == [
        (c.function.name, c.function.arguments) for c in check_calls(whole, set(SCHEMAS))
    ]


def test_a_forced_call_cut_short_is_content(client: openai.OpenAI) -> None:
    """max_tokens ends the call before its arguments open: the text is content, finish_reason "length"."""
    reply = chat(client, tool_choice="required", max_tokens=8)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == '<tool_call>\n{"na'[: len(choice.message.content or "")] != ""
    chunks = list(chat(client, tool_choice="required", max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_streamed_call_keeps_every_logprob(client: openai.OpenAI) -> None:
    """A stream whose text turns into tool calls still lists each token's logprob once."""
    whole = chat(client, tool_choice="required", logprobs=True)
    chunks = list(chat(client, tool_choice="required", logprobs=True, stream=True))
    listed = [
        t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
    ]
    assert (
        listed == [t.token for t in whole.choices[0].logprobs.content] and len(listed) == whole.usage.completion_tokens
    )


def test_auto_and_none_answer_with_content(client: openai.OpenAI) -> None:
    """The random model writes no call: ``auto`` returns its text as content, as ``none`` does (the same prompt,
    tools included, so the same greedy text)."""
    auto, none = (chat(client, tool_choice=choice, max_tokens=12) for choice in ("auto", "none"))
    for reply in (auto, none):
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    assert auto.choices[0].message.content == none.choices[0].message.content
    assert auto.usage.prompt_tokens == none.usage.prompt_tokens
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert plain.usage.prompt_tokens < auto.usage.prompt_tokens  # the tools are in the prompt


def test_agent_turns_prefill_only_the_new_tool_result(client: openai.OpenAI) -> None:
    """Turn N+1 of an agent loop reads the tools block and the whole history (turn N's call included) from
    the cache: what it prefills is the tool's result and the next question. Another user's first turn reads the
    system prompt and tools block."""
    messages = list(QUESTION)
    previous: Any = None
    for turn in range(3):
        reply = chat(client, messages=messages, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        usage = reply.usage
        if previous is not None:
            # all of turn N's prompt and its answer but its last token (the end of turn, never fed)
            assert usage.prompt_tokens_details.cached_tokens >= previous.prompt_tokens + previous.completion_tokens - 1
        previous = usage
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        call = check_calls(message, {"get_weather"})[0]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny, turn {turn}"})
        if turn == 1:
            messages.append({"role": "user", "content": "And tomorrow?"})
    # another user, the same system prompt and tools: all but the question and the turn's end come from the cache
    other = chat(client, messages=[QUESTION[0], {"role": "user", "content": "Oslo?"}], tool_choice="none", max_tokens=1)
    tail = len("Oslo?<|im_end|>\n<|im_start|>assistant\n")  # bytes: the model is byte-level
    assert other.usage.prompt_tokens_details.cached_tokens >= other.usage.prompt_tokens - tail


def test_history_with_parallel_calls(client: openai.OpenAI) -> None:
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
    ]
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_a", "content": "rain"},
    ]
    reply = chat(client, messages=messages, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(reply.choices[0].message, set(SCHEMAS))) == 1
    alone = chat(client, messages=messages[:3], tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens  # both results are in the prompt


BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]},
        "tools[0].function.parameters: invalid json_schema",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "an object"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "appears twice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
    (
        {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
        "messages[2].tool_call_id: this tool message answers 'call_x', which matches no tool call",
    ),
    ({"messages": [*QUESTION, {"role": "tool", "content": "1"}]}, "has no tool_call_id"),
    (
        {
            "messages": [
                *QUESTION,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}],
                },
            ]
        },
        "messages[2].tool_calls[0].function.arguments: not a JSON object",
    ),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
]


@pytest.mark.parametrize("fields,message", BAD_BODIES)
def test_bad_tool_input_is_a_400(server: ServerProcess, fields: dict[str, Any], message: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 4, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert_idle_and_conserved(server.url)


def test_openai_agents_tool_loop(server: ServerProcess) -> None:
    """openai-agents, unchanged: the forced call reaches our function parsed, and its result goes back."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    model = OpenAIChatCompletionsModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    )
    settings = ModelSettings(tool_choice="get_weather", max_tokens=120, temperature=0)
    agent = Agent(
        name="weather", instructions="Use the tools.", tools=[get_weather], model=model, model_settings=settings
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=3))
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and len(seen) == 1 and seen[0] in ("Paris", "Tokyo")
    assert result.new_items[1].output == f"sunny in {seen[0]}"
    # the second request carried the call and its result, and found the first turn in the cache
    first, second = result.raw_responses[:2]
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_langchain_tool_loop(server: ServerProcess) -> None:
    """langchain-openai, unchanged: bind_tools with a forced call, the parsed call run, its ToolMessage sent back;
    and the same call streamed (LangChain merges the chunks)."""
    from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return f"12:00 {zone}"

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="none", max_retries=0, max_tokens=120, temperature=0
    )  # type: ignore[call-arg]
    forced = llm.bind_tools([get_time], tool_choice="get_time")
    messages: list[Any] = [HumanMessage("Time?")]
    ai = forced.invoke(messages)
    assert [call["name"] for call in ai.tool_calls] == ["get_time"] and ai.tool_calls[0]["args"]["zone"] in (
        "UTC",
        "CET",
    )
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    messages += [ai, ToolMessage(get_time.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_time]).invoke(messages)
    assert answer.usage_metadata is not None and answer.usage_metadata["input_token_details"]["cache_read"] > 0
    merged: AIMessageChunk | None = None
    for piece in forced.stream(messages[:1]):
        merged = piece if merged is None else merged + piece  # type: ignore[assignment]
    assert merged is not None and [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in ai.tool_calls
    ]


def test_pydantic_ai_tool_loop(server: ServerProcess) -> None:
    """pydantic-ai, unchanged: a capability forces get_weather on step 1 and the structured output tool after
    (its documented per-step tool_choice); the call reaches our function, its result goes back, and the output
    tool's arguments validate into the output model."""
    from dataclasses import dataclass

    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: Literal["Paris", "Tokyo"]
        sunny: bool

    @dataclass
    class WeatherFirst(AbstractCapability[None]):
        def get_model_settings(self) -> Any:
            return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step == 1 else ["final_result"]}

    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="none")
    settings: Any = {"temperature": 0, "max_tokens": 120}
    agent = Agent(
        OpenAIChatModel(MODEL, provider=provider),
        output_type=Weather,
        model_settings=settings,
        capabilities=[WeatherFirst()],
    )
    seen: list[str] = []

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    result = agent.run_sync("Weather in Paris?")
    assert isinstance(result.output, Weather) and len(seen) == 1
    returned = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
    assert returned[0].tool_name == "get_weather" and returned[0].content == f"sunny in {seen[0]}"
    assert result.usage.requests == 2 and result.usage.tool_calls == 1
