"""Reasoning parsers, the reasoning-then-schema grammar and /tokenize's options, without a server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.model.tokenizer import Tokenizer
from radixserve.server.errors import APIError
from radixserve.server.reasoning import REASONING_PARSERS, after_reasoning, delta_fields, split_reasoning
from radixserve.server.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from tests.support.archs import TOKENIZERS_DIR

# Recorded shapes of real outputs: DeepSeek-R1 (template opened <think>), Qwen3 (it writes the tag itself).
RECORDED = [
    ("deepseek-r1", "Okay, 2 + 2.\n</think>\n\nThe answer is 4.", ("Okay, 2 + 2.", "The answer is 4.")),
    ("deepseek-r1", "<think>\nOkay.\n</think>\n\n4", ("Okay.", "4")),
    ("qwen3", "<think>\nLet me add.\n</think>\n\n4", ("Let me add.", "4")),
    ("qwen3", "<think>\n\n</think>\n\nHello!", ("", "Hello!")),  # thinking off: an empty block
    ("qwen3", "Hello!", (None, "Hello!")),  # no block at all
    ("qwen3", "a < b, so </thin", (None, "a < b, so </thin")),
    # unterminated (max_tokens cut it): all of it is reasoning, no content
    ("qwen3", "<think>\nStill thinking about </thi", ("Still thinking about </thi", None)),
    ("deepseek-r1", "Still thinking", ("Still thinking", None)),
    ("qwen3", "<thi", (None, "<thi")),  # a partial tag that never completed is text
    ("deepseek-r1", "", ("", None)),
    # only the first end tag counts: later ones are content
    ("qwen3", "<think>x</think>y</think>z", ("x", "y</think>z")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), RECORDED)
def test_split_reasoning_of_recorded_outputs(parser: str, text: str, expected: tuple[str | None, str | None]) -> None:
    assert split_reasoning(parser, text) == expected


def streamed(parser: str, parts: list[str]) -> tuple[str | None, str | None]:
    """What a client assembles from the streamed deltas of ``parts`` (the last one carries finish_reason)."""
    streams: dict[int, Any] = {}
    deltas = [delta_fields(streams, parser, 0, part, i == len(parts) - 1) for i, part in enumerate(parts)]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    opened = streams[0].seen_reasoning
    return (reasoning if opened else None), (content or None) if opened else content


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "</th", "think>", " ", "\n", "a", "b c", ">"])


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(sorted(REASONING_PARSERS)), pieces=st.lists(PIECES, max_size=12), data=st.data())
def test_any_split_of_a_stream_assembles_to_the_whole_answer(parser: str, pieces: list[str], data: Any) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(parser, parts) == split_reasoning(parser, text)


def test_a_tag_split_across_deltas_is_never_streamed_as_text() -> None:
    parts = ["<th", "ink>\nstep one <", "/thi", "nk>\n\nan", "swer"]
    streams: dict[int, Any] = {}
    deltas = [delta_fields(streams, "qwen3", 0, part, i == len(parts) - 1) for i, part in enumerate(parts)]
    assert all("<" not in "".join(d.values()) for d in deltas), deltas
    assert streamed("qwen3", parts) == ("step one", "answer")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def accepts(ebnf: str, text: str) -> bool:
    import xgrammar as xgr

    return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text))


@pytest.mark.parametrize(
    ("parser", "text", "ok"),
    [
        ("qwen3", '<think>\nhmm, a < b\n</think>\n\n{"a": 1}', True),
        ("qwen3", '{"a": 1}', True),  # the block is optional in qwen3 style
        ("qwen3", "<think>x</think>not json", False),
        ("qwen3", '<think>x</think>{"b": 1}', False),
        ("deepseek-r1", 'thinking</think>\n{"a": 2}', True),
        ("deepseek-r1", '{"a": 2}', False),  # the reasoning must end first
    ],
)
def test_response_format_applies_after_the_reasoning(parser: str, text: str, ok: bool) -> None:
    params = after_reasoning(parser, {"json_schema": json.dumps(SCHEMA), "temperature": 0.0})
    assert set(params) == {"ebnf", "temperature"}
    assert accepts(params["ebnf"], text) is ok


def test_an_ebnf_constraint_moves_after_the_reasoning_too() -> None:
    params = after_reasoning("qwen3", {"ebnf": 'root ::= "yes" | "no"'})
    assert accepts(params["ebnf"], "<think>maybe</think>\n\nyes") and not accepts(params["ebnf"], "<think>x</think>y")


def test_after_reasoning_leaves_other_constraints_and_names_a_bad_schema() -> None:
    assert after_reasoning("qwen3", {"regex": "a+"}) == {"regex": "a+"}
    with pytest.raises(APIError) as err:
        after_reasoning("qwen3", {"json_schema": json.dumps({"type": "object", "not": {}})})
    assert err.value.status == 400 and "not" in err.value.message


class FakeState:
    """What /tokenize reads of the server: the tokenizer (on this thread) and the context length."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.engine = SimpleNamespace(context_length=512)

    async def tokenize(self, fn: Callable[[Tokenizer], Any], texts: list[str], param: str) -> Any:
        return fn(self.tokenizer)


@pytest.fixture(scope="module")
def llama_state() -> Any:
    """SentencePiece llama's tokenizer: it adds <s> (id 1) to a prompt unless told not to."""
    return FakeState(Tokenizer.from_hf_folder(TOKENIZERS_DIR / "spm-llama"))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_add_special_tokens_and_round_trip(llama_state: Any) -> None:
    with_bos = run(tokenize(llama_state, TokenizeRequest(prompt="hello world", return_token_strs=True)))
    without = run(tokenize(llama_state, TokenizeRequest(prompt="hello world", add_special_tokens=False)))
    assert with_bos["tokens"] == [1, *without["tokens"]] and with_bos["count"] == without["count"] + 1
    assert with_bos["token_strs"][0] == "<s>" and without["token_strs"] is None
    assert with_bos["max_model_len"] == 512
    back = run(detokenize(llama_state, DetokenizeRequest(tokens=without["tokens"])))
    assert back["prompt"] == back["text"] == "hello world"


def test_messages_go_through_the_chat_template_without_an_extra_bos(llama_state: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    out = run(tokenize(llama_state, TokenizeRequest.model_validate({"messages": messages})))
    assert out["tokens"] == llama_state.tokenizer.apply_chat_template(messages)
    assert out["tokens"][0] == 1 and out["tokens"][1] != 1  # the template's own <s>, no second one
    doubled = TokenizeRequest.model_validate({"messages": messages, "add_special_tokens": True})
    assert run(tokenize(llama_state, doubled))["tokens"] == [1, *out["tokens"]]


def test_batch_forms_as_sglang_sends_them(llama_state: Any) -> None:
    out = run(tokenize(llama_state, TokenizeRequest(prompt=["a", "b c"], add_special_tokens=False)))
    assert (
        isinstance(out["count"], list) and len(out["tokens"]) == 2 and out["count"] == [len(t) for t in out["tokens"]]
    )
    back = run(detokenize(llama_state, DetokenizeRequest(tokens=out["tokens"])))
    assert back["text"] == ["a", "b c"]


@pytest.mark.parametrize(
    "body",
    [
        TokenizeRequest(),  # neither prompt nor messages
        TokenizeRequest.model_validate({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
    ],
)
def test_tokenize_wants_exactly_one_input(llama_state: Any, body: TokenizeRequest) -> None:
    with pytest.raises(APIError) as err:
        run(tokenize(llama_state, body))
    assert err.value.status == 400


@pytest.mark.parametrize("tokens", [[5, 1 << 20], [-1], [[3], [4, 99999]]])
def test_detokenize_refuses_ids_outside_the_vocabulary(llama_state: Any, tokens: Any) -> None:
    with pytest.raises(APIError) as err:
        run(detokenize(llama_state, DetokenizeRequest(tokens=tokens)))
    assert err.value.status == 400 and "not a token id" in err.value.message
