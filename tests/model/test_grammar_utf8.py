"""Constrained outputs are well-formed UTF-8 and strict JSON, whatever bytes the model prefers.

xgrammar's character classes take encoded surrogates (``ED A0 80``) and, in a JSON schema's length-bounded
string, raw control characters: a random byte-level model drawn towards high bytes wrote both (CI: a
``maxLength: 5`` name that decoded to seven characters). ``grammar_utf8``'s automaton narrows each mask; the
JSON schema's strings refuse U+0000..U+001F. Checked against Python's own decoder, token by token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.model.grammar import GrammarCompiler, GrammarState
from radixserve.model.grammar_utf8 import BETWEEN, Utf8Masks
from tests.support.tiny_model import BYTE_EOS, BYTE_VOCAB

# Completions that finish any well-formed prefix: none, or 1-3 continuation bytes from the edges of each range.
_EDGES = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
_COMPLETIONS = [b""] + [bytes([a]) for a in _EDGES]
_COMPLETIONS += [a + bytes([b]) for a in _COMPLETIONS[1:] for b in _EDGES]
_COMPLETIONS += [a + bytes([b]) for a in _COMPLETIONS[7:] for b in _EDGES]


def well_formed_prefix(data: bytes) -> bool:
    """Brute force: some completion makes ``data`` decode (``decode`` with ``final=False`` takes ``ED A0``)."""
    for tail in _COMPLETIONS:
        try:
            (data + tail).decode("utf-8")
            return True
        except UnicodeDecodeError:
            pass
    return False


INTERESTING = st.sampled_from(
    [0x00, 0x41, 0x7F, *_EDGES, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEE, 0xF0, 0xF3, 0xF4, 0xF5, 0xFF]
)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(max_size=4) | st.lists(INTERESTING, max_size=4).map(bytes), max_size=6))
def test_the_automaton_keeps_exactly_the_well_formed_prefixes(chunks: list[bytes]) -> None:
    """Tokens = the chunks: a walk accepts each token while the bytes so far are a prefix of well-formed UTF-8,
    and stands between characters exactly when they decode whole; the packed words are the same answers."""
    masks = Utf8Masks(chunks, len(chunks) + 1, boundary_only=[len(chunks)])
    allowed = np.unpackbits(masks.words.numpy().view(np.uint8), axis=1, bitorder="little")[:, : len(chunks) + 1]
    assert (allowed == (masks.after.T != Utf8Masks.STATES)).all()
    state, text = BETWEEN, b""
    for token, chunk in enumerate(chunks):
        assert masks.allows(state, len(chunks)) == (state == BETWEEN)  # the stop token: between characters only
        text += chunk
        if not well_formed_prefix(text):
            assert not masks.allows(state, token)
            with pytest.raises(ValueError, match="malformed UTF-8"):
                masks.step(state, token)
            return
        state = masks.step(state, token)
        decodes = True
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            decodes = False
        assert (state == BETWEEN) == decodes, text


@pytest.fixture(scope="module")
def compiler(byte_model_dir: Path) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(byte_model_dir), BYTE_VOCAB, [BYTE_EOS])


def allowed(grammar: GrammarState) -> set[int]:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, BYTE_VOCAB)
    grammar.fill_row(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:BYTE_VOCAB]
    return set(np.flatnonzero(bits).tolist())


# The byte model's ids 0..255 are the bytes themselves (in GPT-2's printable mapping): token 0xED is byte ED.
NAME = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}


def test_no_surrogate_no_control_character_and_no_stop_inside_a_character(compiler: GrammarCompiler) -> None:
    grammar = compiler.matcher(compiler.compile("json_schema", json.dumps(NAME)))
    for token in b'{"name": "':
        grammar.accept(token)
    start = allowed(grammar)
    assert 0xED in start and 0x41 in start and not {0x00, 0x09, 0x1F} & start  # controls refused in the string
    grammar.accept(0xED)
    assert allowed(grammar) == set(range(0x80, 0xA0))  # ED A0..BF would encode a surrogate
    assert grammar.accepted_len([0x9F, 0x80, 0x22]) == 3 and grammar.accepted_len([0xA0, 0x80]) == 0
    with pytest.raises(ValueError, match="malformed UTF-8"):
        grammar.accept(0xA0)
    assert allowed(grammar) == set(range(0x80, 0xA0))  # the refused token changed nothing
    grammar.accept(0x9F)
    assert BYTE_EOS not in allowed(grammar) and 0x22 not in allowed(grammar)  # one byte still owed


def test_forced_tokens_walk_through_a_multibyte_character(compiler: GrammarCompiler) -> None:
    """The forced walk narrows each row by the UTF-8 state it has reached: a character's bytes, then the stop."""
    grammar = compiler.matcher(compiler.compile("regex", "\u20ac!"))  # E2 82 AC 21
    assert grammar.forced_tokens(8) == [0xE2, 0x82, 0xAC, 0x21, BYTE_EOS]


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_drawn_to_high_bytes_give_well_formed_strict_json(compiler: GrammarCompiler, seed: int) -> None:
    """What a random byte model at temperature did in CI, made likely: 7 of 10 picks a byte >= 0x80 where any is
    allowed. Every answer decodes cleanly, parses as strict JSON and fits the schema (names <= 5 characters)."""
    import xgrammar as xgr

    rng = random.Random(seed)
    compiled = compiler.compile("json_schema", json.dumps(PERSON))
    for _ in range(40):
        grammar, ids = compiler.matcher(compiled), []
        bitmask = xgr.allocate_token_bitmask(1, BYTE_VOCAB)
        while not grammar.terminated and len(ids) < 80:
            grammar.fill_row(bitmask, 0)
            row = torch.zeros(1, BYTE_VOCAB)
            xgr.apply_token_bitmask_inplace(row, bitmask)
            choices = torch.nonzero(~torch.isneginf(row[0])).flatten().tolist()
            high = [t for t in choices if 0x80 <= t < 256]
            token = rng.choice(high if high and rng.random() < 0.7 else choices)
            grammar.accept(token)
            ids.append(token)
        assert grammar.terminated
        answer = bytes(t for t in ids if t < 256).decode("utf-8")  # strict: raises on malformed bytes
        jsonschema.validate(json.loads(answer), PERSON)
