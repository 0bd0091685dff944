"""Issue 13, continued: logprobs that follow the returned text (7), and a big prompt that does not
hold up small ones while it tokenizes (3)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.engine import Engine
from radixserve.server.app import create_app
from radixserve.server.args import ServerArgs
from radixserve.server.generation import BIG_TEXT_CHARS, ServerState
from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess

# ---- 7. streamed logprobs equal the whole answer's, and leave out the stop string ------------------------


def completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The first choice, streamed chunks merged (text, logprobs lists) when body['stream'] is set."""
    if not body.get("stream"):
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice: dict[str, Any] = response.json()["choices"][0]
        return choice
    merged: dict[str, Any] = {"text": "", "logprobs": {"tokens": [], "token_logprobs": [], "text_offset": []}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])["choices"][0]
            merged["text"] += chunk["text"]
            for key in ("tokens", "token_logprobs", "text_offset"):
                merged["logprobs"][key] += (chunk["logprobs"] or {}).get(key) or []
            merged["finish_reason"] = chunk["finish_reason"] or merged.get("finish_reason")
    return merged


def test_logprobs_follow_the_returned_text_streamed_or_not(server: ServerProcess) -> None:
    base = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    free = completion(server.url, base)
    text, offsets = free["text"], free["logprobs"]["text_offset"]
    assert len(offsets) == 8 and offsets == sorted(offsets) and offsets[0] == 0
    stop = text[offsets[4] : offsets[5]]  # the fifth token's text, with the space before it
    assert stop.strip(), (text, offsets)
    whole = completion(server.url, {**base, "stop": [stop]})
    streamed = completion(server.url, {**base, "stop": [stop], "stream": True})
    assert streamed["text"] == whole["text"] and whole["text"] == text[: text.index(stop)]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert streamed["logprobs"][key] == whole["logprobs"][key], key
    listed = whole["logprobs"]
    assert all(offset < len(whole["text"]) for offset in listed["text_offset"]), (whole, stop)
    assert len(listed["tokens"]) == len(text[: text.index(stop)].split()), "the stop string's tokens are listed"


# ---- 3. a big prompt tokenizes on its own thread ---------------------------------------------------------


@pytest.fixture(scope="module")
def state(tiny_model_dir: Path) -> ServerState:
    engine = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=1024)
    app = create_app(engine, ServerArgs())
    out: ServerState = app.state.radixserve
    return out


def test_a_small_prompt_tokenizes_while_a_big_one_is_still_tokenizing(state: ServerState) -> None:
    state.max_prompt_chars = 10 * BIG_TEXT_CHARS  # the tiny model's own bound is below the big-prompt line
    big_started, release = threading.Event(), threading.Event()

    def big(tokenizer: Any) -> str:
        big_started.set()
        release.wait(60)  # held until the small one is done: one shared thread would deadlock here
        return "big"

    async def both() -> tuple[list[list[int]], str, bool]:
        big_task = asyncio.ensure_future(state.tokenize(big, ["w5 " * BIG_TEXT_CHARS], "prompt"))
        await asyncio.get_running_loop().run_in_executor(None, big_started.wait, 60)
        small = await asyncio.wait_for(
            state.tokenize(lambda tok: [tok.encode("w5 w6")], ["w5 w6"], "prompt"), timeout=60
        )
        still_running = not big_task.done()
        release.set()
        return small, await big_task, still_running

    try:
        small, big_result, still_running = asyncio.run(both())
    finally:
        release.set()
    assert small == [[5, 6]] and big_result == "big" and still_running
