"""Smoke test of the README's serve command on the real embedded model (slow: loads SmolLM2).

``make serve`` runs ``python -m radixserve serve`` with no model flag: the embedded
SmolLM2-135M-Instruct GGUF. An ``openai`` client chat must return sensible text,
and a second chat sharing the template's system prompt must read it from the cache.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-total-tokens", "4096", "--enable-metrics").start(timeout=300)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_openai_chat_on_the_default_model(smollm2: ServerProcess) -> None:
    client = openai.OpenAI(base_url=smollm2.url + "/v1", api_key="none", max_retries=0, timeout=120)
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model=model.id,
        temperature=0,
        max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    again = client.chat.completions.create(
        model=model.id, temperature=0, max_tokens=8, messages=[{"role": "user", "content": "Name a color."}]
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 20  # the template's default system prompt
    assert "resolved server args" in smollm2.log()


def test_the_default_model_runs_its_own_4_bit_blocks(smollm2: ServerProcess) -> None:
    with urllib.request.urlopen(smollm2.url + "/server_info", timeout=60) as reply:
        engine = json.load(reply)["engine"]
    assert (engine["quantization"], engine["resolved_quantization"]) == ("auto", "q4_1-exact")
    assert engine["quantization_reason"].startswith("auto: q4_1-exact,")
    assert "quantization q4_1-exact: auto: q4_1-exact" in smollm2.log()
