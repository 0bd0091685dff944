"""SGLang's own clients work on /generate unchanged, and /get_model_info, /get_server_info answer as SGLang's do.

The source of truth is the sglang package (installed --no-deps by the Makefile): its
request dataclass ``GenerateReqInput`` and its benchmark client's ``/generate`` payload,
read with ``ast`` (importing sglang would pull in its whole runtime).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.server.sglang_fields import HONOURED, SGLANG_FIELDS
from tests.server.conftest import assert_idle_and_conserved
from tests.support.server_process import ServerProcess


def sglang_source(relative: str) -> ast.Module:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed (make install does it)"
    return ast.parse((Path(spec.submodule_search_locations[0]) / relative).read_text())


def request_fields() -> dict[str, Any]:
    """GenerateReqInput's fields and their defaults (None where the default is not a literal)."""
    tree = sglang_source("srt/managers/io_struct.py")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fields: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            try:
                fields[node.target.id] = ast.literal_eval(node.value) if node.value is not None else None
            except ValueError:  # field(default=None, kw_only=True)
                fields[node.target.id] = None
    return fields


def bench_payload_keys() -> set[str]:
    """The keys bench_serving --backend sglang puts in its /generate payload."""
    tree = sglang_source("benchmark/serving.py")
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name.endswith("sglang_generate"))
    keys = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if isinstance(node, ast.Subscript) and isinstance(
            node.slice, ast.Constant
        ):  # payload["top_logprobs_num"] = ...
            if isinstance(node.value, ast.Name) and node.value.id == "payload":
                keys.add(node.slice.value)
    return keys


def generate(url: str, body: dict[str, Any], status: int = 200) -> Any:
    response = httpx.post(url + "/generate", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def test_our_field_list_is_sglangs() -> None:
    assert SGLANG_FIELDS == set(request_fields())


def test_bench_servings_payload_is_accepted(server: ServerProcess) -> None:
    keys = bench_payload_keys()
    assert {"lora_path", "return_logprob", "logprob_start_len", "return_routed_experts"} <= keys
    values = {"lora_path": None, "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1}
    body = {k: v for k, v in values.items() if k in keys}
    body |= {"text": "w5 w6", "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}}
    response = httpx.post(server.url + "/generate", json={**body, "stream": True}, timeout=60)
    lines = [line for line in response.text.splitlines() if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks and chunks[-1]["meta_info"]["completion_tokens"] == 3 and lines[-1] == "data: [DONE]"


def test_every_sglang_field_at_its_default_is_accepted_and_each_ignored_one_is_warned_once(
    server: ServerProcess,
) -> None:
    defaults = {k: v for k, v in request_fields().items() if k not in ("text", "input_ids", "sampling_params")}
    for _ in range(2):
        generate(server.url, {**defaults, "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    log = server.log()
    for name in ("lora_path", "return_hidden_states", "session_params"):
        assert log.count(f"ignoring SGLang field {name!r}") == 1, name
    assert "ignoring SGLang field 'rid'" not in log and all(f"field {n!r}" not in log for n in HONOURED)


@pytest.mark.parametrize(
    "field,value",
    [("lora_path", "adapter-1"), ("return_hidden_states", True), ("image_data", "x.png"), ("max_tokens", 3)],
)
def test_a_field_asking_for_what_we_do_not_do_is_refused(server: ServerProcess, field: str, value: Any) -> None:
    error = generate(server.url, {"input_ids": [5], field: value}, status=400)["error"]
    assert field in error["message"]


def test_honoured_fields(server: ServerProcess) -> None:
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = generate(
        server.url,
        {"input_ids": [5, 6], "sampling_params": params, "rid": "my-id", "return_logprob": True, "top_logprobs_num": 2},
    )
    meta = out["meta_info"]
    assert meta["id"] == "my-id" and len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"]) == 3
    with_text = {
        "input_ids": [5, 6],
        "sampling_params": params,
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    texts = generate(server.url, with_text)["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in texts] == out["output_ids"] and all(entry[2].startswith("w") for entry in texts)
    batch = generate(server.url, {"input_ids": [[5], [6]], "sampling_params": params, "rid": ["a", "b"]})
    assert [o["meta_info"]["id"] for o in batch] == ["a", "b"]


def test_prompt_logprobs_from_logprob_start_len(server: ServerProcess) -> None:
    """SGLang's shape: [logprob, id, text or None] per prompt token from the start; the first has no score."""
    prompt = [5, 6, 7, 8, 9]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    whole = generate(server.url, {**body, "logprob_start_len": 0})["meta_info"]
    assert whole["output_token_logprobs"] == [] and whole["completion_tokens"] == 0
    scored = whole["input_token_logprobs"]
    assert [entry[1] for entry in scored] == prompt and scored[0][0] is None
    assert all(entry[0] < 0 for entry in scored[1:]) and all(entry[2] is None for entry in scored)
    # Cached now: a later start must still compute (not read from the cache) the positions it scores.
    tail = generate(server.url, {**body, "logprob_start_len": 2, "return_text_in_logprobs": True})["meta_info"]
    assert [entry[1:] for entry in tail["input_token_logprobs"]] == [[7, "w7"], [8, "w8"], [9, "w9"]]
    assert tail["input_token_logprobs"][0][0] is None and tail["cached_tokens"] == 2
    for mine, reference in zip(tail["input_token_logprobs"][1:], scored[3:]):
        assert abs(mine[0] - reference[0]) < 1e-4


def test_max_new_tokens_zero_prefills_the_prompt_into_the_cache(server: ServerProcess) -> None:
    """SGLang's frontend caches a prefix before fork with exactly this request: the prompt must reach the cache."""
    before = assert_idle_and_conserved(server.url)
    prefix = [(7 * i) % 120 + 5 for i in range(48)]  # 48 tokens no other test sends
    warm = generate(server.url, {"input_ids": prefix, "sampling_params": {"max_new_tokens": 0}})
    assert warm["text"] == "" and warm["output_ids"] == []
    meta = warm["meta_info"]
    assert meta["prompt_tokens"] == 48 and meta["completion_tokens"] == 0 and meta["cached_tokens"] < 48
    assert meta["finish_reason"] == "length"
    after = assert_idle_and_conserved(server.url)  # no slot leaked: every slot free or cached
    assert after["cached_tokens"] == before["cached_tokens"] + 48 - meta["cached_tokens"]
    branches = [{"input_ids": prefix + [tail], "sampling_params": {"max_new_tokens": 3}} for tail in (9, 10)]
    for body in branches:
        assert generate(server.url, body)["meta_info"]["cached_tokens"] == 48
    streamed = httpx.post(
        server.url + "/generate",
        json={"text": "w5 w6 w7", "sampling_params": {"max_new_tokens": 0}, "stream": True},
        timeout=60,
    )
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["text"] == "" and events[-1]["meta_info"]["finish_reason"] == "length"
    assert_idle_and_conserved(server.url)


def test_model_and_server_info_in_sglangs_shape(server: ServerProcess) -> None:
    model = httpx.get(server.url + "/get_model_info", timeout=30).json()
    assert model["is_generation"] is True and model["model_path"].endswith("tiny-llama") and "tokenizer_path" in model
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["model_path"].endswith("tiny-llama") and info["max_total_num_tokens"] == 4096
    assert isinstance(info["internal_states"], list) and info["internal_states"][0]["num_running"] >= 0
    assert info["version"] and info["max_req_input_len"] == 255
