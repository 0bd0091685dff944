"""Fuzzing: no input gets a 5xx, kills the scheduler, or leaks a slot or a lock.

Three layers, each with a bounded, derandomized example count (``HYPOTHESIS_PROFILE=explore``
multiplies it):

- schemathesis over every operation of the live server's OpenAPI schema, valid and invalid
  requests (half of them name the served model, else almost every OpenAI call is a 404);
- hypothesis in process, on the tiny model: the tokenizer on any text, and
  ``Engine.make_request`` on any prompt and sampling dict, which either raises ValueError or
  returns a request that then runs without an engine error;
- hypothesis over HTTP: any JSON (NaN and huge integers included: the server's JSON parser
  takes them) to each POST endpoint, alone and merged into a valid body; and any stop
  strings, for which a stream must send the text a whole answer has.

A 4xx must carry an OpenAI error body; a 200 stream must carry no error event (a 5xx in
disguise). ``EDGE_CASES`` pins the values that reach the sampler one by one: random
examples at these counts find some of them, not all, on a given run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.core import SamplingParams
from radixserve.engine import Engine
from radixserve.model.tokenizer import IncrementalDecoder
from tests.machine_settings import SCALE
from tests.server.conftest import MODEL, assert_idle_and_conserved
from tests.support.server_process import ServerProcess

FUZZ = settings(max_examples=30 * SCALE, suppress_health_check=list(HealthCheck))
VOCAB, CONTEXT = 128, 256  # the tiny model's
TIMEOUT = 60.0  # per request: a dead scheduler shows as a timeout, not a hung test run

# Values where validation tends to have holes: int64 / uint64 / float32 limits, NaN, wrong types.
ODD: st.SearchStrategy[Any] = st.sampled_from(
    [
        0,
        -1,
        2**63,
        2**64,
        -(2**63) - 1,
        1.5,
        1e-50,
        5e-324,
        1e300,
        math.nan,
        math.inf,
        -math.inf,
        True,
        "",
        "1",
        None,
        [],
        [1],
        [""],
        {},
    ]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | ODD
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
VALUES = ODD | SCALARS | JSON  # a field's value: odd values a third of the time
PARAM_NAMES = [f.name for f in dataclasses.fields(SamplingParams)]
SAMPLING_DICTS = st.dictionaries(st.sampled_from(PARAM_NAMES), VALUES, min_size=1, max_size=2) | st.dictionaries(
    st.text(max_size=6), JSON, max_size=2
)

COMPLETION = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
NATIVE = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
VALID: dict[str, dict[str, Any]] = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/generate": NATIVE}
FIELDS = {
    "/v1/completions": [
        "prompt",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "stream",
        "echo",
        "logprobs",
        "repetition_penalty",
        "stop_token_ids",
        "cache_salt",
    ],
    "/v1/chat/completions": [
        "messages",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "response_format",
    ],
    "/generate": ["text", "input_ids", "stream", "return_logprob", "top_logprobs_num", "extra_key"],
}


# ---- the property every HTTP answer must have -------------------------------------------------

Answer = tuple[int, str, bytes]  # status, content type, body


@dataclass
class Target:
    """The module's server, and whether a request has killed its scheduler.

    Once dead, every request would hang until its timeout, and hypothesis shrinks by
    sending hundreds: so a dead server fails each later example at once.
    """

    server: ServerProcess
    dead: str | None = None  # /health's answer once the scheduler died

    def send(self, request: str, call: Callable[[], Answer]) -> None:
        """Make one call and check its answer: no 5xx, a 4xx is an OpenAI error, a stream carries none."""
        if self.dead is not None:
            pytest.fail(f"an earlier request killed the scheduler ({self.dead}); server log:\n{self.log()}")
        try:
            status, content_type, content = call()
        except Exception:  # a timeout: did the scheduler die?
            self.check_health()
            raise
        if status >= 500:
            self.check_health()
        text = content.decode(errors="replace")
        where = f"{request}\n-> {status} {text[:600]}\n--- server log (tail) ---\n{self.log()}"
        assert status < 500, where
        if status >= 400:
            error = openai_error(text)
            assert error is not None and error["message"] and isinstance(error["type"], str), where
        elif content_type.startswith("text/event-stream"):  # a 5xx in disguise: the status went out first
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    assert "error" not in json.loads(line[len("data: ") :]), where

    def post(self, path: str, body: Any) -> None:
        """POST ``body``: bytes as they are, anything else as JSON (NaN and Infinity included)."""
        raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()

        def call() -> Answer:
            response = httpx.post(
                self.server.url + path, content=raw, timeout=TIMEOUT, headers={"content-type": "application/json"}
            )
            return response.status_code, response.headers.get("content-type", ""), response.content

        self.send(f"POST {path} {raw[:600]!r}", call)

    def check_health(self) -> None:
        health = httpx.get(self.server.url + "/health", timeout=10)
        if health.status_code != 200:
            self.dead = health.text

    def log(self) -> str:
        return self.server.log()[-3000:]


def openai_error(text: str) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI-style error body, or None if it is not one."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, TypeError, KeyError):
        return None
    return error if isinstance(error, dict) and isinstance(error.get("message"), str) else None


@pytest.fixture(scope="module")
def module_target(server: ServerProcess) -> Target:
    return Target(server)


@pytest.fixture
def target(module_target: Target) -> Iterator[Target]:
    """The server, checked healthy, idle and conserved (no slot, no lock left) after each test."""
    yield module_target
    module_target.check_health()
    assert module_target.dead is None, f"the scheduler died: {module_target.dead}\n{module_target.log()}"
    assert_idle_and_conserved(module_target.server.url)


# ---- schemathesis: every operation of the schema ---------------------------------------------

OPERATIONS = [
    "GET /health",
    "GET /server_info",
    "GET /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /generate",
    "GET /cache",
    "POST /flush_cache",
    "GET /metrics",
    "GET /get_model_info",
    "GET /get_server_info",
    "POST /tokenize",
    "POST /v1/tokenize",
    "POST /detokenize",
    "POST /v1/detokenize",
    "POST /v1/embeddings",
    "GET /dashboard/data",
]
WITH_INPUT = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /generate",
    "GET /cache",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/embeddings",
    "GET /dashboard/data",
]


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_the_fuzzed_operations_are_every_operation(api_schema: Any) -> None:
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)


@pytest.mark.parametrize(
    "label,mode", [(op, "positive") for op in OPERATIONS] + [(op, "negative") for op in WITH_INPUT]
)
def test_schemathesis_gets_no_server_error(target: Target, api_schema: Any, label: str, mode: str) -> None:
    method, path = label.split(" ", 1)
    strategy = api_schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @FUZZ
    @given(case=strategy, served_model=st.booleans())
    def check(case: Any, served_model: bool) -> None:
        body = case.body
        if served_model and isinstance(body, dict) and isinstance(body.get("model"), str):
            body["model"] = MODEL
        if isinstance(body, dict) and type(body.get("n")) is int:  # 64 choices x 16 prompts: minutes on a CPU
            body["n"] = min(body["n"], 4)

        def call() -> Answer:
            response = case.call(base_url=target.server.url, timeout=TIMEOUT)
            return response.status_code, (response.headers.get("content-type") or [""])[0], response.content

        target.send(case.as_curl_command(), call)

    check()


# ---- in process: the tokenizer and the prompt path ---------------------------------------------

TEXT = st.text(st.characters(codec="utf-8"), max_size=40)  # any character but a lone surrogate
LONG_WORD = st.builds(lambda word, times: word * times, st.text(min_size=1, max_size=3), st.integers(100, 3000))
WORDS = st.lists(st.sampled_from([f"w{i}" for i in range(3, VOCAB)]), min_size=1, max_size=12)
IDS = st.lists(st.integers(0, VOCAB - 1), max_size=12)
BAD_ID = st.integers(-3, VOCAB + 3) | st.integers()
GOOD_PROMPTS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
PROMPTS = st.one_of(
    GOOD_PROMPTS,
    st.lists(BAD_ID, max_size=8),
    st.lists(st.integers(0, VOCAB - 1), min_size=CONTEXT - 8, max_size=CONTEXT + 8),  # the context's edge
    st.lists(st.lists(BAD_ID, max_size=3), max_size=3),  # nested, ragged or not
    st.lists(SCALARS, max_size=4),  # not integers at all
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine.create(model_path=str(tiny_model_dir), max_total_tokens=4096)


@FUZZ
@given(text=TEXT | LONG_WORD | st.sampled_from(["\x00", "\u200b\ufeff", "w5\r\nw6\tw7", "<s></s><unk>", "w" * 10**5]))
def test_any_text_encodes_in_the_vocabulary_and_decodes(engine: Engine, text: str) -> None:
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
    assert isinstance(tokenizer.decode(ids), str) and isinstance(tokenizer.decode(ids, skip_special_tokens=False), str)
    assert isinstance(tokenizer.decode_continuation(ids, ids), str)


@FUZZ
@given(words=WORDS, separators=st.lists(st.sampled_from([" ", "\t", "\n", "\r\n", "\u3000", "\x0b"]), min_size=12))
def test_vocabulary_words_round_trip_through_encode_and_decode(
    engine: Engine, words: list[str], separators: list[str]
) -> None:
    text = "".join(word + separator for word, separator in zip(words, separators))
    ids = engine.tokenizer.encode(text)
    assert ids == [int(word[1:]) for word in words]
    assert engine.tokenizer.decode(ids) == " ".join(words)


@FUZZ
@given(prompt=IDS, chunks=st.lists(IDS, max_size=6))
def test_streamed_text_is_the_final_text(engine: Engine, prompt: list[int], chunks: list[list[int]]) -> None:
    decoder = IncrementalDecoder(engine.tokenizer, prompt)
    streamed = "".join(decoder.push(chunk) for chunk in chunks) + decoder.flush()
    output = [i for chunk in chunks for i in chunk]
    assert streamed == engine.tokenizer.decode_continuation(output, prompt)


@FUZZ
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXT | LONG_WORD}
        ),
        min_size=1,
        max_size=4,
    )
)
def test_the_chat_template_gives_ids_in_the_vocabulary(engine: Engine, messages: list[dict[str, str]]) -> None:
    ids = engine.tokenizer.apply_chat_template(messages)
    assert ids and all(0 <= i < VOCAB for i in ids)


@settings(FUZZ, max_examples=10 * FUZZ.max_examples)  # a few ms an example
@given(prompt=GOOD_PROMPTS | PROMPTS, params=st.none() | SAMPLING_DICTS)
def test_make_request_returns_a_request_or_raises_value_error(engine: Engine, prompt: Any, params: Any) -> None:
    try:
        req = engine.make_request(prompt, params)
    except ValueError:
        return
    max_new_tokens = req.params.max_new_tokens  # clipped to what the context leaves
    assert 0 < len(req.prompt_ids) < CONTEXT
    assert isinstance(max_new_tokens, int) and 0 <= max_new_tokens <= CONTEXT - len(req.prompt_ids), params


@settings(FUZZ, max_examples=10 * FUZZ.max_examples)  # ~10 ms an example: the sampler's widest net
@given(
    prompt=GOOD_PROMPTS | PROMPTS, params=st.dictionaries(st.sampled_from(PARAM_NAMES), VALUES, min_size=1, max_size=2)
)
def test_an_accepted_request_runs_without_an_engine_error(engine: Engine, prompt: Any, params: Any) -> None:
    """What make_request accepts, the scheduler can run: the first 8 steps, then an abort."""
    try:
        req = engine.make_request(prompt, params)
    except (ValueError, TypeError):  # TypeError: the test above reports it
        return
    scheduler = engine.scheduler
    scheduler.add(req)
    for _ in range(8):
        if req.finish_reason is not None:
            break
        engine.step()
    if req.finish_reason is None:
        scheduler.abort(req)
    result = req.result()
    engine.check_idle_invariants()
    assert result.error is None, f"{params} on {prompt}: {result.error}"


# ---- over HTTP: any JSON to each POST endpoint -------------------------------------------------

POSTS = ["/v1/completions", "/v1/chat/completions", "/generate"]


@pytest.mark.parametrize("path", POSTS)
def test_any_json_body_gets_no_server_error(target: Target, path: str) -> None:
    @FUZZ
    @given(body=JSON | st.binary(max_size=40))
    def check(body: Any) -> None:
        target.post(path, body)

    check()


@pytest.mark.parametrize("path", POSTS)
def test_a_valid_body_with_any_fields_replaced_gets_no_server_error(target: Target, path: str) -> None:
    changes = st.dictionaries(st.sampled_from(FIELDS[path]), VALUES, min_size=1, max_size=2) | st.dictionaries(
        st.text(max_size=6), JSON, min_size=1, max_size=2
    )
    if path == "/generate":
        changes = changes | st.builds(lambda sp: {"sampling_params": sp}, SAMPLING_DICTS)

    @settings(FUZZ, max_examples=3 * FUZZ.max_examples)  # the likeliest to reach the sampler
    @given(changes=changes)
    def check(changes: dict[str, Any]) -> None:
        target.post(path, {**VALID[path], **changes})

    check()


@FUZZ
@given(stop=st.lists(st.sampled_from(["", " ", "w", "w1", "1 w", "\n"]) | st.text(max_size=3), max_size=3), words=WORDS)
def test_streamed_and_whole_completions_agree_whatever_the_stop_strings(
    target: Target, stop: list[str], words: list[str]
) -> None:
    body = {
        "model": MODEL,
        "prompt": " ".join(words),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stop": stop,
    }
    whole = httpx.post(target.server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    streamed = httpx.post(target.server.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"], json.dumps(body)


def native(**params: Any) -> dict[str, Any]:
    return {**NATIVE, "sampling_params": {"max_new_tokens": 2, **params}}


# (name, path, body): values at the edges of what the sampler takes. 4xx or 200, never a 5xx.
EDGE_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("top_p below float32's smallest", "/v1/completions", {**COMPLETION, "top_p": 1e-50}),
    ("top_p below float32's smallest, streamed", "/v1/chat/completions", {**CHAT, "top_p": 1e-50, "stream": True}),
    ("repetition_penalty below float32's smallest", "/v1/chat/completions", {**CHAT, "repetition_penalty": 1e-50}),
    ("top_k beyond int64", "/v1/completions", {**COMPLETION, "top_k": 2**63}),
    ("temperature NaN", "/v1/completions", {**COMPLETION, "temperature": math.nan}),
    ("seed at the last n", "/v1/completions", {**COMPLETION, "seed": 2**63 - 1, "n": 64}),
    ("native: temperature NaN", "/generate", native(temperature=math.nan)),
    ("native: repetition_penalty NaN", "/generate", native(repetition_penalty=math.nan)),
    ("native: top_p below float32's smallest", "/generate", native(top_p=1e-50)),
    ("native: top_k beyond int64", "/generate", native(top_k=2**63)),
    ("native: fractional top_logprobs", "/generate", native(top_logprobs=1.5)),
    ("native: a non-string stop", "/generate", native(stop=[1])),
    ("native: seed beyond uint64", "/generate", native(seed=2**64)),
    ("native: seed below int64", "/generate", native(seed=-(2**63) - 1)),
    ("native: fractional seed", "/generate", native(seed=1.5)),
    ("native: max_new_tokens NaN", "/generate", native(max_new_tokens=math.nan, ignore_eos=True)),
    ("embeddings: a token id beyond int64", "/v1/embeddings", {"model": MODEL, "input": [2**63]}),
    ("embeddings: an empty prompt among others", "/v1/embeddings", {"model": MODEL, "input": [[5, 6], []]}),
    ("detokenize: an id beyond uint64", "/detokenize", {"tokens": [2**64]}),
    (
        "tokenize: a final assistant message continued and a generation prompt",
        "/tokenize",
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
    ),
]


@pytest.mark.parametrize("name,path,body", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_values_get_no_server_error(target: Target, name: str, path: str, body: dict[str, Any]) -> None:
    target.post(path, body)
