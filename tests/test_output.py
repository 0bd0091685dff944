"""The output stage (engine/output.py): text made once, incrementally; stop strings on new text only.

Counts decoded tokens and searched characters, never time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import radixserve.engine.output as output_module
from radixserve import Engine
from radixserve.core import SamplingParams
from radixserve.engine.output import OutputCursor, OutputStage, listed_tokens
from radixserve.model.tokenizer import Tokenizer, find_stop
from radixserve.scheduler.batch import StepOutput
from radixserve.scheduler.request import Request
from tests.model.tiny import EOS, save_word_tokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tok")
    save_word_tokenizer(folder)
    return Tokenizer.from_hf_folder(folder)


def make_engine(tiny_model_dir: Path) -> Engine:
    return Engine.create(model_path=str(tiny_model_dir), max_total_tokens=2048, dtype="float32")


def request(prompt: Sequence[int], **params: Any) -> Request:
    return Request(0, np.asarray(prompt, dtype=np.int64), SamplingParams(**{"max_new_tokens": 64, **params}))


def test_text_is_held_back_while_a_stop_may_form_and_cut_where_it_matched(word_tokenizer: Tokenizer) -> None:
    stage, cursor = OutputStage(word_tokenizer, (EOS,)), OutputCursor()
    prompt, output = [3, 4], [10, 11, 12, 13, 14]
    req = request(prompt, stop=["w12 w13"])
    stops, deltas = [], []
    for token in output[:4]:
        stops.append(stage.append(req, StepOutput(token)))
        deltas.append(cursor.take(req).text)
    # "w12" may start the stop: held back (the space before it goes); " w13" completes it: cut there
    assert deltas == [" w10", " w11", " ", ""] and stops == [None, None, None, "w12 w13"]
    stage.finish(req)
    full = word_tokenizer.decode_continuation(output, prompt)
    final = full[: full.index("w12 w13")]
    assert cursor.take(req).text == "" and req.text == final == " w10 w11 "
    assert req.text_offsets == [0, 4, 8, 12]  # each token's start in the (uncut) text


def test_text_without_stops_equals_decode_continuation(word_tokenizer: Tokenizer) -> None:
    stage, cursor = OutputStage(word_tokenizer, (EOS,)), OutputCursor()
    prompt, output = [5, 6, 7], [20, 2, 21, 1, 22]  # specials (eos, bos) are skipped
    req = request(prompt, ignore_eos=True)
    text = ""
    for token in output:
        assert stage.append(req, StepOutput(token)) is None
        text += cursor.take(req).text
    assert text == word_tokenizer.decode_continuation(output, prompt) == " w20 w21 w22"
    stage.finish(req)
    assert cursor.take(req).text == "" and req.text == text


def test_stop_strings_search_only_new_text(word_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """O(n): each token's search covers the held-back tail and the new text, never the whole output."""
    searched: list[int] = []
    real = output_module.find_stop

    def counting(text: str, stops: Any, start: int = 0) -> Any:
        searched.append(len(text))
        return real(text, stops, start)

    monkeypatch.setattr(output_module, "find_stop", counting)
    stage = OutputStage(word_tokenizer, (EOS,))
    stops = ["w9 w9 w9 w9", "never"]
    req = request([3], stop=stops, max_new_tokens=2000)
    output = [9, 9, 9, 12] * 500  # " w9 w9 w9" is held back again and again, never completed
    assert all(stage.append(req, StepOutput(t)) is None for t in output)
    stage.finish(req)
    longest = max(map(len, stops))
    assert len(searched) == len(output) and max(searched) < longest + len(" w12")
    assert req.text == word_tokenizer.decode_continuation(output, [3])


def test_a_long_output_with_a_stop_string_decodes_each_token_a_bounded_number_of_times(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the output stage, every new token decoded the whole output again: O(n^2) token decodes."""
    engine = make_engine(tiny_model_dir)
    decoded: list[int] = []
    decode = engine.tokenizer.decode

    def counting(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        decoded.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "decode", counting)
    n = 240
    out = engine.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": n, "stop": ["never"]})
    assert len(out.output_ids) == n and out.finish_reason == "length"
    assert sum(decoded) <= 6 * n  # a window of a few tokens per step (the whole output: ~n^2 / 2 = 28,800)
    monkeypatch.undo()
    assert out.text == engine.tokenizer.decode_continuation(out.output_ids, [3, 4, 5])


def test_two_stop_strings_at_one_place_the_longer_wins_as_find_stop_says(tiny_model_dir: Path) -> None:
    """Both stop strings match at the start of the first token's text; the step used to pick the
    lexicographically smaller one (the shorter, a prefix of the other); find_stop picks the longer."""
    engine = make_engine(tiny_model_dir)
    prompt = [3, 4, 5]
    free = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 4})
    first = engine.tokenizer.decode_continuation(free.output_ids[:1], prompt)  # " w57"-like
    stops = [first[:-1], first]
    match = find_stop(first, stops)
    assert match is not None and match.stop == first
    cut = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 4, "stop": stops})
    assert cut.finish_reason == "stop" and cut.matched_stop == match.stop and cut.text == match.text == ""
    assert cut.output_ids == free.output_ids[:1]


def test_the_step_changes_no_request_its_sampling_state_included(tiny_model_dir: Path) -> None:
    """Running the same batch twice samples the same tokens: the step reads the sampling state and
    only the output stage advances it (it used to advance each request's generator)."""
    engine = make_engine(tiny_model_dir)
    sched = engine.scheduler
    reqs = [
        engine.make_request([3 + i, 9, 17], {"temperature": 50.0, "seed": i, "max_new_tokens": 3}) for i in range(4)
    ]
    for req in reqs:
        sched.add(req)
    batch = sched.schedule()
    first = engine.executor.run(batch)
    assert engine.executor.run(batch) == first and all(req.output_ids == [] for req in reqs)
    sched.process(batch, first)
    assert [req.output_ids for req in reqs] == [[out.token] for out in first]
    while sched.has_work():
        engine.step()
    engine.check_idle_invariants()


def test_listed_logprob_tokens_streamed_equal_the_whole_answer(word_tokenizer: Tokenizer) -> None:
    stage, cursor = OutputStage(word_tokenizer, (EOS,)), OutputCursor()
    req = request([3], stop=["w12 w13"], logprobs=True)
    streamed: list[int] = []
    for k, token in enumerate([10, 11, 12, 13]):
        stop = stage.append(req, StepOutput(token, logprob=-float(k)))
        streamed += cursor.take(req).listed.token_ids
    assert stop == "w12 w13"
    req.matched_stop = stop
    stage.finish(req)
    req.finish("stop")
    streamed += cursor.take(req).listed.token_ids
    whole = listed_tokens(req.result())
    # " w13" starts at the end of the cut text " w10 w11 ": the stop string's token is not listed
    assert streamed == whole.token_ids == [10, 11, 12]
    assert whole.starts == [0, 4, 8] and whole.logprobs == [0.0, -1.0, -2.0]


@pytest.fixture(scope="module")
def byte_tokenizer(byte_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(byte_model_dir)  # one token per byte: characters split across tokens


def decode_everything_each_token(
    tok: Tokenizer, prompt: list[int], ids: list[int], stops: list[str]
) -> tuple[str, str | None, int]:
    """The reference: the whole output decoded again after each token, find_stop on all of it."""
    for taken in range(1, len(ids) + 1):
        match = find_stop(tok.decode_continuation(ids[:taken], prompt), stops)
        if match is not None:
            return match.text, match.stop, taken
    return tok.decode_continuation(ids, prompt), None, len(ids)


TEXT = st.text(alphabet="ab é😀\n", max_size=24)


@settings(max_examples=200, deadline=None)
@given(
    text=TEXT, stops=st.lists(st.text(alphabet="ab é😀\n", min_size=1, max_size=4), max_size=3), cut=st.integers(0, 3)
)
def test_text_and_stops_equal_decoding_everything_each_token(
    byte_tokenizer: Tokenizer, text: str, stops: list[str], cut: int
) -> None:
    """Same text, same stop, same token count as the O(n^2) reference, also when the output ends
    inside a character (``cut`` bytes off: the final text keeps decode's U+FFFD)."""
    prompt = byte_tokenizer.encode("p", add_special_tokens=False)
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    ids = ids[: max(len(ids) - cut, 0)] or ids
    if not ids:
        return
    stage, cursor = OutputStage(byte_tokenizer, ()), OutputCursor()
    req = request(prompt, stop=stops, max_new_tokens=len(ids))
    stop, streamed = None, ""
    while stop is None and len(req.output_ids) < len(ids):
        stop = stage.append(req, StepOutput(ids[len(req.output_ids)]))
        streamed += cursor.take(req).text
    stage.finish(req)
    streamed += cursor.take(req).text
    assert (req.text, stop, len(req.output_ids)) == decode_everything_each_token(byte_tokenizer, prompt, ids, stops)
    assert streamed == req.text


def test_a_stop_string_before_an_unfinished_character_stops_at_that_token() -> None:
    """SmolLM2's " \\xf0\\x9f\\x98" token ends inside an emoji: the space before it is text already, as a
    whole decode shows it ("a \\ufffd"), so the stop "a " matches at that token, not one later."""
    tok = Tokenizer.from_model_path(None)
    prompt, ids = tok.encode("p", add_special_tokens=False), tok.encode("a 😀 b", add_special_tokens=False)
    stage = OutputStage(tok, ())
    req = request(prompt, stop=["a "])
    stops = [stage.append(req, StepOutput(token)) for token in ids[:2]]
    stage.finish(req)
    assert stops == [None, "a "] and tok.decode(ids[:2]) == "a \ufffd"
    assert (req.text, stops[-1], 2) == decode_everything_each_token(tok, prompt, ids, ["a "]) == ("", "a ", 2)
