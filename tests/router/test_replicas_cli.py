"""``radixserve serve --replicas 2`` as users run it: a local Ray cluster, the OpenAI API, a clean stop."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import ServerProcess

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def test_serve_replicas_from_the_command_line(tiny_model_dir: Path) -> None:
    from openai import OpenAI

    proc = ServerProcess("--replicas", "2", "--log-level", "warning", model_path=tiny_model_dir).start(timeout=600)
    try:
        deadline = time.monotonic() + 300  # /health answers once the front and one replica are up
        while len(httpx.get(proc.url + "/router", timeout=120).json().get("replicas", [])) < 2:
            assert time.monotonic() < deadline, "the second replica never came up"
            time.sleep(0.2)
        client = OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        system = {"role": "system", "content": " ".join(f"w{i}" for i in range(3, 90))}
        usages = []
        for question in ("w5 w6", "w7 w8", "w9 w10"):
            reply = client.chat.completions.create(
                model="tiny-llama",
                max_tokens=4,
                extra_body={"ignore_eos": True},
                messages=[system, {"role": "user", "content": question}],
            )
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            usages.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert usages[0] == 0 and all(cached >= 80 for cached in usages[1:]), usages  # one replica kept the prefix
        state = httpx.get(proc.url + "/router", timeout=120).json()
        assert state["policy"] == "cache-aware" and len(state["replicas"]) == 2
        assert state["decisions"].get("prefix") == 2  # the second and third chats followed the first
    finally:
        code = proc.stop(signal.SIGINT, timeout=120)  # Ctrl-C: drain, delete the app, stop the local cluster
    assert code == 0, proc.log()[-3000:]
