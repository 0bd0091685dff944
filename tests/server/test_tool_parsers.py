"""Tool-call parsers on recorded model outputs (whole and streamed), the forced-call grammar, and the round trip
arguments -> chat template -> text -> parser for each format (hypothesis). No server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import xgrammar as xgr
from hypothesis import given
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState

from radixserve.model.tokenizer import Tokenizer
from radixserve.server.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolStream,
    detect_parser,
    parse_tool_calls,
)
from radixserve.server.tools import ToolPlan, ToolReplies, forced_grammar

FIXTURES = Path(__file__).parents[1] / "fixtures"
TEMPLATES = FIXTURES / "templates"
# format -> (template file, what ends an assistant turn in it: Mistral's eos is the tokenizer's, SmolLM2's here)
FORMATS = {
    "hermes": ("qwen2.5-tools.jinja", "<|im_end|>\n"),
    "llama3_json": ("llama3.2-tools.jinja", "<|eot_id|>"),
    "mistral": ("mistral-nemo-tools.jinja", "<|im_end|>"),
}
WEATHER = '{"city": "Paris", "days": 3}'

# (parser, recorded output, content, calls as (name, arguments))
RECORDED = [
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>',
        "Let me look.\n",
        [("a", "{}"), ("b", '{"x": [1, 2]}')],
    ),
    ("hermes", ' \n<tool_call>{"name": "a", "arguments": {}}</tool_call>', None, [("a", "{}")]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"q": "é"}}',
        None,
        [("a", "{}"), ("b", '{"q": "é"}')],
    ),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        '{"name": "a", "arguments": {}, "id": "abc123XYZ"}]',
        None,
        [("get_weather", WEATHER), ("a", "{}")],
    ),
]
# Outputs that hold no complete, valid call: all of it is content.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # truncated
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}\n</tool_call>'),  # unbalanced JSON
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}, "extra": 1}\n</tool_call>'),
    ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
    ("llama3_json", '{"name": "f", "parameters": {"a": '),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),  # not a list
    ("mistral", "[TOOL_CALLS]["),
]


def calls_of(step: Any) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for _, call in step.calls]


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_recorded_outputs_parse(name: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    step = parse_tool_calls(PARSERS[name](), text)
    assert calls_of(step) == calls
    assert (step.content or None) == content


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_or_truncated_calls_are_content(name: str, text: str) -> None:
    step = parse_tool_calls(PARSERS[name](), text)
    assert step.calls == [] and step.content == text


def test_a_bad_call_after_good_ones_ends_the_calls() -> None:
    good = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    step = parse_tool_calls(HermesParser(), good + "\n<tool_call>\n{oops}\n</tool_call> tail")
    assert calls_of(step) == [("a", "{}")] and step.content == "\n<tool_call>\n{oops}\n</tool_call> tail"
    step = parse_tool_calls(MistralParser(), '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": 3}]')
    assert calls_of(step) == [("a", "{}")] and step.content == ', {"name": 3}]'
    cut = parse_tool_calls(MistralParser(), '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu')
    assert calls_of(cut) == [("a", '{"x": 1}')] and cut.content == ', {"name": "b", "argu'
    plain = "no calls here, only text <tool"
    assert parse_tool_calls(HermesParser(), plain).content == plain
    assert parse_tool_calls(Llama3JsonParser(), "  hello {").content == "  hello {"


def test_call_ids() -> None:
    assert MistralParser().new_call_id().isalnum() and len(MistralParser().new_call_id()) == 9
    ids = {HermesParser().new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("call_") for i in ids)


def assemble(deltas: list[Any]) -> list[tuple[str, str]]:
    """Calls from stream pieces, as a client joins them: a piece with an id opens a call, the rest append."""
    calls: list[list[str]] = []
    for piece in deltas:
        if piece.id is not None:
            assert piece.arguments == "" and piece.name
            calls.append([piece.name, ""])
        else:
            calls[-1][1] += piece.arguments
    return [(name, arguments) for name, arguments in calls]


@given(data=st.data())
def test_streaming_cuts_like_the_whole_answer(data: st.DataObject) -> None:
    """However the text arrives, the stream's content and calls (and, assembled, its pieces) are the whole
    answer's. Incremental streaming (forced calls: they always complete) sends argument pieces early."""
    name, text, _, calls = data.draw(st.sampled_from(RECORDED + [(n, t, None, []) for n, t in MALFORMED]))
    incremental = bool(calls) and data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    stream = ToolStream(PARSERS[name](), incremental)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    steps = [stream.push(piece) for piece in pieces[:-1]] + [stream.push(pieces[-1], final=True)]
    whole = parse_tool_calls(PARSERS[name](), text)
    assert "".join(s.content for s in steps) == whole.content
    assert [c for s in steps for c in calls_of(s)] == calls_of(whole)
    assert assemble([d for s in steps for d in s.deltas]) == calls_of(whole)


def test_forced_calls_stream_their_arguments_as_they_are_written() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    stream = ToolStream(HermesParser(), incremental=True)
    steps = [stream.push(ch) for ch in text] + [stream.push("", final=True)]
    heads = [i for i, s in enumerate(steps) if any(d.id for d in s.deltas)]
    done = [i for i, s in enumerate(steps) if s.calls]
    assert heads == [text.index('{"city')] and done == [len(text) - 1]  # the head once the arguments' { is out
    fragments = [d.arguments for s in steps for d in s.deltas if d.id is None and d.arguments]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "days": 3}'
    cut = ToolStream(HermesParser(), incremental=True)  # max_tokens ends it inside the arguments
    steps = [cut.push(ch) for ch in text[:60]] + [cut.push("", final=True)]
    assert assemble([d for s in steps for d in s.deltas]) == [("get_weather", text[text.index('{"city') : 60])]
    assert not any(s.content for s in steps) and not any(s.calls for s in steps)


def test_detect_parser_from_templates() -> None:
    for name, (template, _) in FORMATS.items():
        assert detect_parser((TEMPLATES / template).read_text(encoding="utf-8")) == name
    assert detect_parser((FIXTURES / "tokenizers/bpe-smollm/chat_template.jinja").read_text(encoding="utf-8")) is None


def chunk(delta: dict[str, Any], finish: str | None = None) -> openai.types.chat.ChatCompletionChunk:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return openai.types.chat.ChatCompletionChunk.model_validate(
        {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
    )


def test_stream_deltas_assemble_in_the_openai_client() -> None:
    """Two parallel calls streamed byte by byte: the openai client's own accumulator rebuilds both."""
    _, text, _, calls = RECORDED[1]
    replies = ToolReplies(ToolPlan([], "auto", None, True, HermesParser(), True))
    state = ChatCompletionStreamState()
    state.handle_chunk(chunk({"role": "assistant", "content": ""}))
    deltas = [d for ch in text for d in replies.deltas(0, ch, final=False)] + replies.deltas(0, "", final=True)
    first_call = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert first_call["function"] == {"name": "a", "arguments": ""} and first_call["id"].startswith("call_")
    for delta in deltas:
        state.handle_chunk(chunk(delta))
    state.handle_chunk(chunk({}, "tool_calls"))
    message = state.get_final_completion().choices[0].message
    assert message.content == "Let me look.\n"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls


def test_forced_grammar_shapes() -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "b"}},
    ]
    one = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    for parallel, forced, accepted, refused in [
        (True, None, [one, one + "\n" + one.replace('"a"', '"b"')], ['{"name": "a", "arguments": {}}']),
        (False, None, [one], [one + "\n" + one]),
        (True, "b", [one.replace('"a"', '"b"')], [one]),
    ]:
        plan = ToolPlan(tools, "function" if forced else "required", forced, parallel, HermesParser(), True)
        grammar = xgr.Grammar.from_ebnf(forced_grammar(plan))
        assert all(xgr.testing._is_grammar_accept_string(grammar, t) for t in accepted)
        assert not any(xgr.testing._is_grammar_accept_string(grammar, t) for t in refused)
    mistral = ToolPlan(tools, "required", None, True, MistralParser(), True)
    grammar = xgr.Grammar.from_ebnf(forced_grammar(mistral))
    assert xgr.testing._is_grammar_accept_string(
        grammar, '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    )


# ---- the round trip: any schema-valid arguments -> the template's text -> the parser ----------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "note": {"type": ["string", "null"]}}},
    },
    "required": ["city"],
}
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
NUMBER = st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False, width=32))
ARGUMENTS = st.fixed_dictionaries(
    {"city": TEXT},
    optional={
        "days": st.integers(-(2**40), 2**40),
        "ratio": NUMBER,
        "metric": st.booleans(),
        "tags": st.lists(TEXT, max_size=3),
        "where": st.fixed_dictionaries({}, optional={"lat": NUMBER, "note": st.none() | TEXT}),
    },
)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    base = Tokenizer.from_hf_folder(FIXTURES / "tokenizers/bpe-smollm")
    return {name: base.with_chat_template(TEMPLATES / template) for name, (template, _) in FORMATS.items()}


def assistant_text(tokenizer: Tokenizer, arguments: dict[str, Any], end: str) -> str:
    """What the template writes for the assistant's call: the text a model trained on it would output."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    user = [{"role": "user", "content": "Weather?"}]
    call = {"id": "abcdefgh1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    head = tokenizer.render_chat(user, add_generation_prompt=True, tools=tools)
    whole = tokenizer.render_chat(
        [*user, {"role": "assistant", "content": "", "tool_calls": [call]}], add_generation_prompt=False, tools=tools
    )
    assert whole.startswith(head) and whole.endswith(end)
    return whole[len(head) : len(whole) - len(end)]


def in_schema_order(value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``value`` with its keys in the schema's order, as constrained decoding writes them."""
    properties = schema.get("properties", {})
    return {
        key: in_schema_order(value[key], properties[key]) if isinstance(value[key], dict) else value[key]
        for key in properties
        if key in value
    }


@given(arguments=ARGUMENTS)
def test_schema_valid_arguments_survive_template_text_and_parser(
    tokenizers: dict[str, Tokenizer], arguments: dict[str, Any]
) -> None:
    jsonschema.validate(arguments, SCHEMA)
    for name, (_, end) in FORMATS.items():
        text = assistant_text(tokenizers[name], arguments, end)
        step = parse_tool_calls(PARSERS[name](), text)
        assert [call.name for _, call in step.calls] == ["get_weather"], (name, text)
        assert json.loads(step.calls[0][1].arguments) == arguments and not step.content.strip()
        if name != "mistral":  # Mistral's template writes its call id into the object; the model's calls have none
            text = assistant_text(tokenizers[name], in_schema_order(arguments, SCHEMA), end)
            tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
            plan = ToolPlan(tools, "required", None, False, PARSERS[name](), True)
            grammar = xgr.Grammar.from_ebnf(forced_grammar(plan))
            assert xgr.testing._is_grammar_accept_string(grammar, text.strip()), (name, text)
