"""The OpenAI-compatible API, driven by the official ``openai`` client against a live tiny-model server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, assert_idle_and_conserved
from tests.support.server_process import ServerProcess


def words(ids: range | list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_then_shared_prefix_reports_cached_tokens(client: openai.OpenAI, server: ServerProcess) -> None:
    prefix = words(range(10, 50))  # 40 tokens
    first = client.completions.create(model=MODEL, prompt=prefix + " w60 w61", max_tokens=6, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prefix + " w70", max_tokens=6, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == 42 and first.usage.completion_tokens == 6
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 40
    assert first.choices[0].finish_reason == "length" and first.object == "text_completion"
    assert len(first.choices[0].text.split()) == 6
    assert_idle_and_conserved(server.url)


def test_max_tokens_zero_caches_the_prompt_like_sglangs_max_new_tokens_zero(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    prefix = words(range(80, 120))  # 40 tokens
    warm = client.completions.create(model=MODEL, prompt=prefix, max_tokens=0)
    assert warm.choices[0].text == "" and warm.choices[0].finish_reason == "length"
    assert warm.usage is not None and warm.usage.prompt_tokens == 40 and warm.usage.completion_tokens == 0
    hit = client.completions.create(model=MODEL, prompt=prefix + " w7", max_tokens=2, temperature=0)
    assert hit.usage is not None and hit.usage.prompt_tokens_details is not None
    assert hit.usage.prompt_tokens_details.cached_tokens == 40
    assert_idle_and_conserved(server.url)


def test_stream_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    prompt, params = words(range(3, 13)), dict(max_tokens=12, temperature=0)
    whole = client.completions.create(model=MODEL, prompt=prompt, **params)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **params
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 10 - 1  # all but the last prompt token: the same prompt ran


def test_stop_string_cuts_the_text_the_same_streamed_or_not(client: openai.OpenAI) -> None:
    prompt = words(range(80, 90))
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    stop = free.split()[3]  # the 4th word generated
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop])
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop], stream=True
        )
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)] == streamed
    assert stop not in cut.choices[0].text


def test_chat_applies_the_template_and_streams(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "w5 w6 w7"}, {"role": "user", "content": "w8 w9"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    # template: "w4 w5 w6 w7 w5 w8 w9 w99" -> 8 prompt tokens
    assert reply.usage is not None and reply.usage.prompt_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_with_seed_differ_and_reproduce(client: openai.OpenAI) -> None:
    params = dict(model=MODEL, prompt=words(range(20, 30)), max_tokens=8, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**params)  # type: ignore[call-overload]
    again = client.completions.create(**params)  # type: ignore[call-overload]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # a seed per choice
    assert first.usage is not None and first.usage.prompt_tokens == 10 and first.usage.completion_tokens == 24


def test_n_choices_stream_by_index(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w40"}],
            max_tokens=5,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index[0] == by_index[1] and by_index[0]  # greedy: identical choices
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == 3


def test_logprobs_chat_and_completion(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w11 w12"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy = most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
    templated = "w4 w11 w12 w99"  # the same prompt as the chat's
    done = client.completions.create(
        model=MODEL, prompt=templated, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    block = done.choices[0].logprobs
    assert block is not None and block.tokens is not None and len(block.tokens) == 4
    assert block.top_logprobs is not None and all(len(top) == 2 for top in block.top_logprobs)
    assert block.token_logprobs == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_cache_salt_partitions_the_cache(server: ServerProcess) -> None:
    """Paired: the same salt hits, a different salt misses (a miss alone would pass with caching off)."""
    body = {"model": MODEL, "prompt": words(range(90, 120)), "max_tokens": 2, "temperature": 0}

    def cached(salt: str) -> int:
        out = httpx.post(server.url + "/v1/completions", json={**body, "cache_salt": salt}, timeout=60).json()
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 29
    assert cached("tenant-b") == 0
    unsalted = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_echo_and_token_id_prompts(client: openai.OpenAI) -> None:
    echoed = client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("w5 w6 ")
    by_ids = client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 5
    assert by_ids.choices[0].text == echoed.choices[0].text[len("w5 w6") :]


def test_n_choices_of_the_largest_seed_do_not_repeat_seed_0s(client: openai.OpenAI) -> None:
    """Choice j's seed is no ``seed + j``: at 2^63-1 that wrapped (torch's CPU generator keeps the low 32 bits),
    so choices 1-2 of seed 2^63-1 were choices 0-1 of seed 0."""
    params = dict(model=MODEL, prompt=words(range(20, 30)), max_tokens=12, temperature=1.0)

    def texts(seed: int, n: int) -> list[str]:
        out = client.completions.create(**params, n=n, seed=seed)  # type: ignore[call-overload]
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    top, zero = texts((1 << 63) - 1, 3), texts(0, 2)
    assert top == texts((1 << 63) - 1, 3)  # reproducible
    assert top[1] != zero[0] and top[2] != zero[1]
    assert texts(0, 1) == zero[:1]  # choice 0 is the seed itself, as with n=1


def test_choice_seeds_are_distinct_and_in_range() -> None:
    from radixserve.server.openai_api import choice_seed

    for seed in (0, 1, 7, (1 << 32) - 1, 1 << 32, (1 << 63) - 1):
        seeds = [choice_seed(seed, j) for j in range(8)]
        assert seeds[0] == seed and all(0 <= s < 1 << 63 for s in seeds)
        assert len({s & 0xFFFFFFFF for s in seeds}) == 8  # the bits the CPU generator keeps
    assert choice_seed((1 << 63) - 1, 1) != 0 and choice_seed((1 << 63) - 1, 2) not in (0, 1, choice_seed(0, 1))
