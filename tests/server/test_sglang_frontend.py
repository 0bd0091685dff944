"""SGLang's own frontend language (``sgl.RuntimeEndpoint``) running unchanged against radixserve.

gen, select (ranked by prompt logprobs: checked against HF transformers' logprobs of the same
tokens), fork/join, multi-turn roles, constrained gen (json_schema, regex), streaming and
run_batch, on the tiny byte-level model.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import sglang as sgl
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.conftest import assert_idle_and_conserved
from tests.support.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(byte_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("--max-total-tokens", "4096", "--log-level", "warning", model_path=byte_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def backend(server: ServerProcess) -> Any:
    return sgl.RuntimeEndpoint(server.url)


@sgl.function
def answer(s: Any, question: str) -> None:
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


def test_gen_returns_text_and_sglangs_meta_info(backend: Any) -> None:
    state = answer.run(question="What is 2 + 2?", backend=backend)
    assert isinstance(state["answer"], str) and "\n" not in state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] == len(b"Q: What is 2 + 2?\nA:")  # one token per byte
    assert meta["finish_reason"] in ("stop", "length")
    assert state.text() == "Q: What is 2 + 2?\nA:" + state["answer"]


@sgl.function
def pick(s: Any, choices: list[str]) -> None:
    s += "The colour of the sky is"
    s += sgl.select("colour", choices=choices)


def reference_scores(folder: Path, prefix: str, choices: list[str]) -> list[float]:
    """SGLang's select score computed by hand: the mean logprob (HF transformers) of the tokens from
    position len(prefix) - 1 on, given everything before each."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    start = len(tokenizer.encode(prefix)) - 2
    scores = []
    for choice in choices:
        ids = tokenizer.encode(prefix + choice)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        values = [logprobs[p - 1, ids[p]].item() for p in range(start + 1, len(ids))]
        scores.append(sum(values) / len(values))
    return scores


def test_select_picks_the_choice_with_the_best_prompt_logprobs(backend: Any, byte_model_dir: Path) -> None:
    choices = [" blue", " green", " grey", " red"]
    state = pick.run(choices=choices, backend=backend)
    expected = reference_scores(byte_model_dir, "The colour of the sky is", choices)
    meta = state.get_meta_info("colour")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert state["colour"] == choices[max(range(len(choices)), key=lambda i: expected[i])]


@sgl.function
def tree_of_thought(s: Any, question: str) -> Any:
    s += "Question: " + question + "\n"
    # fork caches the text so far (/generate with max_new_tokens 0) only if its executor thread has already
    # appended it: SGLang checks before syncing. text() syncs, so the cache step always happens here.
    s.text()
    branches = s.fork(3)
    for i, branch in enumerate(branches):
        branch += f"Idea {i}:" + sgl.gen("idea", max_tokens=6, temperature=0)
    branches.join()
    s += "Best:" + sgl.gen("best", max_tokens=4, temperature=0)
    return branches


def test_fork_and_join_share_the_prefix(backend: Any, server: ServerProcess) -> None:
    question = "How do we get more throughput out of a shared prefix cache on a small machine?"
    state = tree_of_thought.run(question=question, backend=backend)
    ideas = state["idea"]  # join gathers each branch's variable into a list
    assert isinstance(ideas, list) and len(ideas) == 3 and all(isinstance(idea, str) for idea in ideas)
    assert state.text().startswith("Question: " + question) and state["best"] is not None
    prefix = len(("Question: " + question + "\n").encode())  # one token per byte
    # Every branch, the first admitted included, finds the prefix the fork cached: none computes it
    # (a later branch may also find the first one's "Idea ").
    assert all(branch.get_meta_info("idea")["cached_tokens"] >= prefix for branch in state.ret_value)
    assert state.get_meta_info("best")["cached_tokens"] >= prefix
    assert_idle_and_conserved(server.url)


@sgl.function
def conversation(s: Any) -> None:
    s += sgl.system("You answer briefly.")
    s += sgl.user("Name a colour.")
    s += sgl.assistant(sgl.gen("first", max_tokens=6, temperature=0))
    s += sgl.user("And another one.")
    s += sgl.assistant(sgl.gen("second", max_tokens=6, temperature=0))


def test_multi_turn_roles_and_the_second_turn_hits_the_cache(backend: Any) -> None:
    state = conversation.run(backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["first"] and messages[4]["content"] == state["second"]
    first, second = state.get_meta_info("first"), state.get_meta_info("second")
    assert second["cached_tokens"] >= first["prompt_tokens"]  # the whole first turn's prompt was reused


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}


@sgl.function
def structured(s: Any) -> None:
    s += "Person: " + sgl.gen("person", max_tokens=64, json_schema=json.dumps(SCHEMA), temperature=0.8)
    s += "\nYear: " + sgl.gen("year", max_tokens=8, regex="(19|20)[0-9]{2}")
    s += "\nCount: " + sgl.gen("count", max_tokens=8, dtype=int)


def test_constrained_gen(backend: Any) -> None:
    state = structured.run(backend=backend)
    jsonschema.validate(json.loads(state["person"]), SCHEMA)
    # dtype=int is SGLang's REGEX_INT, [-+]?[0-9]+[ \n]*: a sign may lead ("+3"); the person's sampled
    # answer (temperature 0.8) changes what follows, so the test must accept every string the regex allows.
    assert re.fullmatch("(19|20)[0-9]{2}", state["year"]) and re.fullmatch(r"[-+]?[0-9]+", state["count"].strip())


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """SGLang's ``StreamExecutor.__del__`` ends its executor thread: a garbage collection that ran it inside
    another thread's start (``Thread._bootstrap_inner``) deadlocked ``run_batch`` in CI (Python 3.11, every
    thread waiting). Collect first, in this thread, and not again until the program threads have run."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_streaming_and_run_batch_agree_with_run(backend: Any) -> None:
    with collections_paused():
        alone = answer.run(question="Why is the sky blue?", backend=backend)
        streamed = answer.run(question="Why is the sky blue?", backend=backend, stream=True)
        assert "".join(streamed.text_iter()) == alone.text()
        batch = answer.run_batch([{"question": "Why is the sky blue?"}, {"question": "2+2?"}], backend=backend)
    assert batch[0]["answer"] == alone["answer"] and isinstance(batch[1]["answer"], str)
