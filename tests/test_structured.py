"""Constrained decoding on the offline engine: a random tiny model writes valid output only if the mask works.

The model is random-weight over a byte-level vocabulary, so left alone it writes byte soup
(see ``test_the_mask_changes_what_a_random_model_writes``); every check below that the
output parses, validates or matches is the grammar mask's doing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve import Engine
from radixserve.model.grammar import GrammarError

PROMPT = "Reply in the format asked for: "
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}


@pytest.fixture(scope="module")
def engine(byte_model_dir: Path) -> Engine:
    return Engine.create(model_path=str(byte_model_dir), max_total_tokens=4096, dtype="float32")


def parse(text: str) -> Any:
    return json.loads(text)  # strict: a JSON string holds no raw control character (test_grammar_utf8.py)


def test_json_schema_output_validates_and_stops(engine: Engine) -> None:
    for temperature in (0.0, 1.0):
        out = engine.generate(
            PROMPT, {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 96, "temperature": temperature, "seed": 3}
        )
        assert out.finish_reason == "stop", out
        jsonschema.validate(parse(out.text), SCHEMA)
    engine.check_idle_invariants()


def test_regex_and_ebnf_outputs_match(engine: Engine) -> None:
    out = engine.generate(PROMPT, {"regex": r"[a-c]{2,4}-(x|yz)", "max_new_tokens": 16, "temperature": 1.0, "seed": 1})
    assert out.finish_reason == "stop" and re.fullmatch(r"[a-c]{2,4}-(x|yz)", out.text), out
    grammar = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
    for seed in range(4):
        out = engine.generate(PROMPT, {"ebnf": grammar, "max_new_tokens": 16, "temperature": 1.0, "seed": seed})
        assert out.finish_reason == "stop" and re.fullmatch(r"yes|no|maybe [0-9]", out.text), out


def test_an_empty_negated_class_is_any_one_character(engine: Engine) -> None:
    """EBNF ``[^]`` (issue 37): xgrammar reads it as the complement of nothing, one character of any kind (as in
    JavaScript's regexes; Python's ``re`` refuses the class, so a checker built on it called the answers wrong).
    Every answer is one character, also where the model would rather write a multi-byte one."""
    for seed in range(4):
        out = engine.generate(PROMPT, {"ebnf": "root ::= [^]", "max_new_tokens": 8, "temperature": 1.0, "seed": seed})
        assert out.finish_reason == "stop" and len(out.text) == 1, out
    out = engine.generate(PROMPT, {"ebnf": 'root ::= [^] [^] "!"', "max_new_tokens": 12, "temperature": 1.0})
    assert out.finish_reason == "stop" and len(out.text) == 3 and out.text.endswith("!"), out


def test_the_mask_changes_what_a_random_model_writes(engine: Engine) -> None:
    free = engine.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
    assert not re.fullmatch(r"[0-9]+", free.text)  # the premise of every test here
    digits = engine.generate(PROMPT, {"regex": "[0-9]{8}", "max_new_tokens": 8, "temperature": 0})
    assert re.fullmatch(r"[0-9]{8}", digits.text), digits


def test_a_grammar_that_cannot_finish_in_time_ends_with_length(engine: Engine) -> None:
    out = engine.generate(PROMPT, {"regex": "a{50}", "max_new_tokens": 5, "temperature": 0})
    assert out.finish_reason == "length" and out.text == "aaaaa"
    engine.check_idle_invariants()


def test_each_distinct_spec_compiles_once(engine: Engine) -> None:
    schema = json.dumps({**SCHEMA, "required": ["name"]})
    before = engine.grammars.compiles
    outs = engine.generate([PROMPT + "a", PROMPT + "b", PROMPT + "c"], {"json_schema": schema, "max_new_tokens": 64})
    assert all(o.finish_reason == "stop" for o in outs)
    assert engine.grammars.compiles == before + 1
    engine.generate(PROMPT, {"regex": "[ab]", "max_new_tokens": 4})
    engine.generate(PROMPT, {"regex": "[ab]", "max_new_tokens": 4})
    assert engine.grammars.compiles == before + 2


def test_constrained_requests_share_the_prefix_cache(engine: Engine) -> None:
    prompt = "A long shared system prompt for constrained requests. " * 3
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 96, "temperature": 0}
    first = engine.generate(prompt + "one", params)
    second = engine.generate(prompt + "two", params)
    assert second.cached_tokens >= len(prompt) - 1 > first.cached_tokens
    jsonschema.validate(parse(second.text), SCHEMA)


def test_an_unconstrained_neighbour_is_unchanged_by_a_constrained_one(engine: Engine) -> None:
    plain = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = engine.generate("Tell me something.", plain)
    both = engine.generate(
        [PROMPT, "Tell me something."], [{"regex": "[0-9]{12}", "max_new_tokens": 12, "temperature": 0}, plain]
    )
    assert both[1].output_ids == alone.output_ids
    assert re.fullmatch("[0-9]{12}", both[0].text)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"json_schema": "{not json"}, "invalid json_schema"),
        ({"json_schema": '{"type": "object", "properties": 5}'}, "invalid json_schema"),
        ({"regex": "(ab"}, "invalid regex: Regex parsing error"),
        ({"ebnf": "root ::= missing_rule"}, 'Rule "missing_rule" is not defined'),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of"),
        # issue 37: each compiled and was answered with output its own constraint rejects (or compiled for minutes)
        ({"json_schema": '{"type": "object", "required": ["a"], "additionalProperties": false}'}, "is required but"),
        ({"json_schema": '{"not": {}}'}, "keyword 'not' at # is not supported"),
        ({"json_schema": '{"type": "number", "minimum": 1e308}'}, "minimum 1e+308 is beyond"),
        ({"json_schema": '{"type": "string", "const": 5}'}, "no value of its const/enum satisfies"),
        ({"json_schema": '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'}, "'uniqueItems'"),
        ({"json_schema": '{"allOf": [{"type": "integer"}, {"minimum": 3}]}'}, "allOf with several branches"),
        ({"json_schema": '{"type": "string", "minLength": 5, "maxLength": 2}'}, "minLength 5 > maxLength 2"),
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": "strin"}}}'}, "invalid json_schema"),
        ({"json_schema": '{"type": "object", "properties": {"a": ' * 30 + "{}" + "}}" * 30}, "too complex: nested"),
        ({"regex": "a{99999999999}"}, "regex too complex: repetition {99999999999}"),
    ],
)
def test_a_bad_spec_is_an_error_that_changes_nothing(engine: Engine, params: dict[str, Any], words: str) -> None:
    free = engine.allocator.free_size()
    compiles = engine.grammars.compiles
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        engine.generate(PROMPT, {**params, "max_new_tokens": 4})
    assert isinstance(info.value, GrammarError) or "at most one" in words
    assert engine.grammars.compiles == compiles and engine.allocator.free_size() == free
    engine.check_idle_invariants()


# ---- random small schemas and regexes -----------------------------------------------------------

LEAVES = st.one_of(
    st.builds(
        lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n}, st.integers(-50, 50), st.integers(0, 999)
    ),
    st.builds(lambda hi: {"type": "number", "minimum": 0, "maximum": hi}, st.integers(1, 99)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n}, st.integers(0, 2), st.integers(0, 3)
    ),
    st.builds(
        lambda v: {"enum": v}, st.lists(st.sampled_from(["red", "green", "a b", "7", 3, None]), min_size=1, unique=True)
    ),
    st.builds(lambda v: {"const": v}, st.sampled_from(["x", 12, True])),
    st.just({"type": "string", "pattern": "^[a-c]{1,3}$"}),
    st.just({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}),
)


def _object(props: dict[str, Any], required: int, closed: bool) -> dict[str, Any]:
    schema = {"type": "object", "properties": props, "required": sorted(props)[:required]}
    return {**schema, "additionalProperties": False} if closed else schema


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.builds(
            _object,
            st.dictionaries(st.sampled_from(["a", "bc", "key"]), inner, min_size=1, max_size=3),
            st.integers(1, 3),
            st.booleans(),
        ),
        st.builds(
            lambda items, lo, n: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + n},
            inner,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
    ),
    max_leaves=4,
).filter(lambda s: s.get("type") == "object")

ATOMS = st.sampled_from(["a", "b", "[a-c]", "[0-9]", r"\.", "(x|yz)"])
PIECES = st.builds(lambda atom, q: atom + q, ATOMS, st.sampled_from(["", "?", "{1,3}", "{2}"]))
REGEXES = st.builds(
    lambda left, right: "".join(left) + ("|" + "".join(right) if right else ""),
    st.lists(PIECES, min_size=1, max_size=4),
    st.lists(PIECES, max_size=2),
)


@settings(max_examples=12)
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 0.7, 1.5]), seed=st.integers(0, 1000))
def test_random_schemas_give_valid_json(engine: Engine, schema: dict[str, Any], temperature: float, seed: int) -> None:
    params = {"json_schema": json.dumps(schema), "max_new_tokens": 200, "temperature": temperature, "seed": seed}
    out = engine.generate(PROMPT, params)
    assert out.finish_reason == "stop", (schema, out)
    jsonschema.validate(parse(out.text), schema)


@settings(max_examples=12)
@given(regex=REGEXES, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_random_regexes_are_matched(engine: Engine, regex: str, temperature: float, seed: int) -> None:
    out = engine.generate(PROMPT, {"regex": regex, "max_new_tokens": 32, "temperature": temperature, "seed": seed})
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), (regex, out)


def test_a_grammar_the_vocabulary_cannot_spell_is_refused(tiny_model_dir: Path) -> None:
    """The word-level tiny model has tokens "w3".."w127": no output can be "0" or begin with "{"."""
    words_engine = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=512, dtype="float32")
    for params in ({"regex": "0"}, {"json_schema": json.dumps(SCHEMA)}):
        with pytest.raises(GrammarError, match="no token of this model's vocabulary can begin a match"):
            words_engine.generate(input_ids=[5, 6], sampling_params={**params, "max_new_tokens": 4})
    out = words_engine.generate(input_ids=[5, 6], sampling_params={"regex": "w7( w9)?", "max_new_tokens": 4})
    assert out.text.strip() in ("w7", "w7 w9") and out.finish_reason == "stop", out
    words_engine.check_idle_invariants()
