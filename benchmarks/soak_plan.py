"""What ``radixserve bench soak`` sends: a seeded plan of normal, disconnecting, aborting and malformed calls."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Literal

NUM_PREFIX_GROUPS = 8
Kind = Literal["normal", "disconnect", "abort", "bad"]


@dataclass(frozen=True)
class SoakCall:
    kind: Kind
    label: str  # what the call tests: "completions", "bad:unknown-model", ...
    path: str
    body: dict[str, Any] | bytes  # bytes: sent as they are (malformed JSON, bad UTF-8)
    stream: bool = False
    close_after_events: int | None = None  # disconnect (N events read) / abort as it starts (0)
    client_timeout_s: float | None = None  # abort before or right after the server reads it
    num_requests: int = 1  # engine requests it makes (n choices, a batch): each counts in requests_total


@dataclass(frozen=True)
class ServerFacts:
    model: str
    vocab_size: int
    context_len: int


def plan_calls(
    n: int, facts: ServerFacts, *, disconnect_fraction: float, bad_fraction: float, abort_fraction: float, seed: int
) -> list[SoakCall]:
    """``n`` calls, the kinds in the given shares (rounded), shuffled; the same for the same seed."""
    rng = random.Random(seed)
    groups = [token_ids(rng, facts, facts.context_len // 8) for _ in range(NUM_PREFIX_GROUPS)]
    shares: dict[Kind, float] = {"disconnect": disconnect_fraction, "bad": bad_fraction, "abort": abort_fraction}
    kinds: list[Kind] = [kind for kind, share in shares.items() for _ in range(round(n * share))]
    kinds = kinds[:n] + ["normal"] * (n - len(kinds))
    rng.shuffle(kinds)
    calls = []
    for kind in kinds:
        if kind == "bad":
            calls.append(bad_call(rng, facts))
            continue
        stream = kind in ("disconnect", "abort") or rng.random() < 0.5
        if kind == "abort" and rng.random() < 0.5:  # the other half: cancel by a tiny timeout, not streamed
            stream = False
        call = normal_call(rng, facts, groups, stream, long=kind != "normal")
        if kind == "disconnect":
            call = replace(call, kind="disconnect", close_after_events=rng.randint(1, 4))
        elif kind == "abort" and stream:
            call = replace(call, kind="abort", close_after_events=0)
        elif kind == "abort":
            call = replace(call, kind="abort", client_timeout_s=rng.uniform(0.001, 0.05))
        calls.append(call)
    return calls


def token_ids(rng: random.Random, facts: ServerFacts, length: int) -> list[int]:
    return [rng.randrange(3, facts.vocab_size) for _ in range(length)]  # 0-2: unk, bos, eos in the tiny model


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)  # the tiny model's tokenizer: one token a word


def normal_call(rng: random.Random, facts: ServerFacts, groups: list[list[int]], stream: bool, long: bool) -> SoakCall:
    """A well-formed request; ``long``: one that runs long enough to be dropped mid-way (ignores EOS)."""
    ctx = facts.context_len
    if rng.random() < 0.8:
        prefix, question = rng.choice(groups), token_ids(rng, facts, rng.randint(4, max(4, ctx // 32)))
    else:
        prefix, question = [], token_ids(rng, facts, rng.randint(16, ctx // 8))
    # long: far more tokens than a dropped stream reads (1-4 events), so it is still decoding when the
    # server sees the client go, however fast the step (ctx // 16 finished first now and then)
    max_tokens = ctx // 2 if long else rng.choice([1, 4, 16, 32, ctx // 16])
    sampling = {"temperature": rng.choice([0.0, 0.8]), "ignore_eos": long or rng.random() < 0.5}
    endpoint = rng.choices(["completions", "chat", "generate"], weights=[45, 45, 10])[0]
    n = 2 if rng.random() < 0.1 else 1  # several engine requests behind one HTTP request
    if endpoint == "generate":
        prompts = [prefix + question] + [prefix + token_ids(rng, facts, len(question))] * (n - 1)
        body = {
            "input_ids": prompts if n > 1 else prompts[0],
            "stream": stream,
            "sampling_params": {"max_new_tokens": max_tokens, **sampling},
        }
        return SoakCall("normal", endpoint, "/generate", body, stream, num_requests=n)
    common = {"model": facts.model, "max_tokens": max_tokens, "n": n, "stream": stream, **sampling}
    if stream and rng.random() < 0.5:
        common["stream_options"] = {"include_usage": True}
    if endpoint == "completions":
        return SoakCall(
            "normal", endpoint, "/v1/completions", {**common, "prompt": prefix + question}, stream, num_requests=n
        )
    messages = [{"role": "user", "content": words(question)}]
    if prefix:  # half the prefix as words: a real tokenizer may make several tokens of one
        messages.insert(0, {"role": "system", "content": words(prefix[: len(prefix) // 2])})
    return SoakCall(
        "normal", endpoint, "/v1/chat/completions", {**common, "messages": messages}, stream, num_requests=n
    )


def bad_call(rng: random.Random, facts: ServerFacts) -> SoakCall:
    """A request the server must refuse with a 4xx, whether or not it asks for a stream."""
    ok = {"model": facts.model, "prompt": token_ids(rng, facts, 8), "max_tokens": 4, "stream": rng.random() < 0.5}
    chat = {**ok, "messages": [{"role": "user", "content": "w5 w6"}]}
    del chat["prompt"]
    cases: dict[str, tuple[str, dict[str, Any] | bytes]] = {
        "malformed-json": ("/v1/completions", b'{"model": "m", "prompt": [5, 6'),
        "bad-utf8": ("/v1/completions", b'{"prompt": "w5 \xff\xfe w6", "max_tokens": 4}'),
        "prompt-wrong-type": ("/v1/completions", {**ok, "prompt": {"w5": 1}}),
        "max-tokens-wrong-type": ("/v1/completions", {**ok, "max_tokens": "ten"}),
        "max-tokens-negative": ("/v1/completions", {**ok, "max_tokens": -3}),
        "prompt-too-long": ("/v1/completions", {**ok, "prompt": token_ids(rng, facts, facts.context_len + 16)}),
        "max-tokens-beyond-context": ("/v1/completions", {**ok, "max_tokens": 2 * facts.context_len}),
        "unknown-model": ("/v1/completions", {**ok, "model": "no-such-model"}),
        "empty-prompt": ("/v1/completions", {**ok, "prompt": ""}),
        "unsupported-field": ("/v1/completions", {**ok, "logit_bias": {"5": 10}}),
        "messages-wrong-type": ("/v1/chat/completions", {**chat, "messages": "w5 w6"}),
        "chat-unknown-model": ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        "generate-both-inputs": ("/generate", {"text": "w5", "input_ids": [5], "stream": ok["stream"]}),
        "generate-bad-params": ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "x"}}),
    }
    label = rng.choice(sorted(cases))
    path, body = cases[label]
    return SoakCall("bad", "bad:" + label, path, body, isinstance(body, dict) and bool(body.get("stream")))
