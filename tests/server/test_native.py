"""The native API (/generate), the cache endpoints and the server's self-description, over raw httpx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import torch

from radixserve.model.precision import resolve_dtype
from tests.server.conftest import MODEL, assert_idle_and_conserved, cache_state
from tests.support.server_process import ServerProcess

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def generate(url: str, **body: Any) -> Any:
    response = httpx.post(url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_text_and_input_ids_agree(server: ServerProcess) -> None:
    by_text = generate(server.url, text="w30 w31 w32 w33", sampling_params=GREEDY)
    by_ids = generate(server.url, input_ids=[30, 31, 32, 33], sampling_params=GREEDY)
    assert by_text["output_ids"] == by_ids["output_ids"] and len(by_ids["output_ids"]) == 6
    meta = by_ids["meta_info"]
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6 and meta["finish_reason"] == "length"
    assert meta["cached_tokens"] == 3 and meta["e2e_latency"] > 0  # the first call cached the prompt
    assert by_ids["text"] == by_text["text"]


def test_a_json_body_is_read_whatever_its_content_type(server: ServerProcess) -> None:
    """``curl -d '{...}'`` sends application/x-www-form-urlencoded."""
    body = json.dumps({"input_ids": [30, 31], "sampling_params": GREEDY}).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        response = httpx.post(
            server.url + "/generate", content=body, headers={"content-type": content_type}, timeout=60
        )
        assert response.status_code == 200 and len(response.json()["output_ids"]) == 6


def test_generate_batch_and_per_prompt_params(server: ServerProcess) -> None:
    outs = generate(
        server.url,
        input_ids=[[40, 41], [42, 43, 44]],
        sampling_params=[{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 3}],
    )
    assert isinstance(outs, list) and [len(o["output_ids"]) for o in outs] == [2, 3]


def test_generate_stream_sends_growing_text_then_done(server: ServerProcess) -> None:
    events = []
    with httpx.stream(
        "POST",
        server.url + "/generate",
        timeout=60,
        json={"input_ids": [50, 51, 52], "sampling_params": GREEDY, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    whole = generate(server.url, input_ids=[50, 51, 52], sampling_params=GREEDY)
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert all(whole["text"].startswith(c["text"]) for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"] == "length"


def test_extra_key_partitions_and_logprobs(server: ServerProcess) -> None:
    ids = list(range(60, 80))
    assert (
        generate(server.url, input_ids=ids, sampling_params=GREEDY, extra_key="k1")["meta_info"]["cached_tokens"] == 0
    )
    again = generate(
        server.url, input_ids=ids, sampling_params=GREEDY, extra_key="k1", return_logprob=True, top_logprobs_num=2
    )
    assert again["meta_info"]["cached_tokens"] == 19
    assert len(again["meta_info"]["output_token_logprobs"]) == 6
    assert all(len(step) == 2 for step in again["meta_info"]["output_top_logprobs"])
    assert (
        generate(server.url, input_ids=ids, sampling_params=GREEDY, extra_key="k2")["meta_info"]["cached_tokens"] == 0
    )


def test_cache_summary_shows_the_shared_prefix(server: ServerProcess) -> None:
    shared = list(range(100, 124))
    for tail in ([3, 4], [5, 6], [7, 8]):
        generate(server.url, input_ids=shared + tail, sampling_params=GREEDY)
    state = cache_state(server.url)
    assert state["kind"] == "radix" and state["nodes"] >= 4 and state["invariants"] == "ok"
    words = " ".join(f"w{i}" for i in shared)
    top = [p for p in state["top_shared_prefixes"] if p["tokens"] == len(shared) and p["children"] >= 3]
    assert top, state["top_shared_prefixes"]
    assert top[0]["head_text"] == words and top[0]["hit_count"] >= 3


def test_flush_cache_empties_the_tree(server: ServerProcess) -> None:
    generate(server.url, input_ids=[9, 10, 11], sampling_params=GREEDY)
    assert cache_state(server.url)["cached_tokens"] > 0
    response = httpx.post(server.url + "/flush_cache", timeout=30)
    assert response.status_code == 200 and response.json()["flushed"]
    state = assert_idle_and_conserved(server.url)
    assert state["cached_tokens"] == 0 and state["free_tokens"] == state["pool_tokens"]
    assert generate(server.url, input_ids=[9, 10, 11], sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


def test_server_info_has_the_resolved_args(server: ServerProcess) -> None:
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    args, engine = info["server_args"], info["engine"]
    assert args["prefix_cache"] == "radix" and args["served_model_name"] == MODEL and args["enable_metrics"]
    assert engine["kv_pool_tokens"] == 4096 and engine["resolved_device"] == "cpu"
    dtype, reason = resolve_dtype("float32", torch.device("cpu"))  # the tests' servers pin it (tests/conftest.py)
    assert engine["resolved_dtype"] == str(dtype).removeprefix("torch.") and engine["context_length"] == 256
    assert engine["dtype_reason"] == reason and engine["kv_tokens_per_gib"] == 2**30 // engine["kv_bytes_per_token"]
    assert "prefill_tokens" in info["scheduler"]
    assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
