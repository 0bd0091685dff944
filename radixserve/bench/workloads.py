"""Seeded, token-level workloads the benchmarks replay.

A workload is a list of ``TraceRequest``: the prompt tokens, the tokens the
model will answer with (so a replay can cache the whole conversation turn),
and an optional namespace. Same seed, same tokens, on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.cache.key import TokenArray

VOCAB_SIZE = 49_152  # SmolLM2's vocabulary: token ids look like the real thing


@dataclass(frozen=True)
class TraceRequest:
    prompt: TokenArray
    output: TokenArray
    extra_key: str | None = None


def _segment(rng: np.random.Generator, n: int, vocab_size: int = VOCAB_SIZE) -> TokenArray:
    # Ids 0-2 are special in both SmolLM2 and the tiny test vocabulary.
    return rng.integers(3, vocab_size, size=n, dtype=np.int64)


def support_agent(
    num_users: int = 200,
    turns_per_user: int = 6,
    system_len: int = 512,
    fewshot_len: int = 1543,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> list[TraceRequest]:
    """The chapter's customer-support agent.

    Every prompt is system prompt + few-shot block + the user's conversation so
    far (earlier user messages *and* the agent's replies) + a new message.
    Users interleave at random, so conversations compete for the cache.
    """
    rng = np.random.default_rng(seed)
    preamble = np.concatenate([_segment(rng, system_len, vocab_size), _segment(rng, fewshot_len, vocab_size)])
    histories = [preamble] * num_users
    turns_left = [turns_per_user] * num_users
    requests: list[TraceRequest] = []
    active = list(range(num_users))
    while active:
        user = active[int(rng.integers(len(active)))]
        message = _segment(rng, int(rng.integers(20, 120)), vocab_size)
        reply = _segment(rng, int(rng.integers(50, 300)), vocab_size)
        prompt = np.concatenate([histories[user], message])
        requests.append(TraceRequest(prompt, reply))
        histories[user] = np.concatenate([prompt, reply])
        turns_left[user] -= 1
        if not turns_left[user]:
            active.remove(user)
    return requests


def fewshot_burst(
    num_requests: int = 64, shared_len: int = 2000, suffix_len: int = 50, vocab_size: int = VOCAB_SIZE, seed: int = 0
) -> list[TraceRequest]:
    """``num_requests`` arriving together on one cold shared prefix, each with its own suffix."""
    rng = np.random.default_rng(seed)
    shared = _segment(rng, shared_len, vocab_size)
    return [
        TraceRequest(np.concatenate([shared, _segment(rng, suffix_len, vocab_size)]), _segment(rng, 8, vocab_size))
        for _ in range(num_requests)
    ]
