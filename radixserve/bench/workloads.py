"""Seeded, token-level workloads the benchmarks replay, and the tools around them.

A workload is a list of ``TraceRequest``: the prompt tokens, the tokens the
model will answer with (so a replay can cache the whole conversation turn),
an optional namespace and an optional arrival time. Same seed, same tokens, on
every machine (for one numpy version: numpy does not promise its Generator
streams across releases).

- generators (``WORKLOADS``, ``make_workload``): the shapes DESIGN.md names;
- trace files (``load_trace``, ``save_trace``): Mooncake-style JSONL;
- ``with_poisson_arrivals``: open-loop arrival times for a serving benchmark;
- ``text_of``: the same structure as text, for servers with their own tokenizer;
- ``working_set_tokens``: the cache capacity that holds a whole workload.

Length ranges such as ``doc_len=(1000, 3000)`` are inclusive at both ends.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

from radixserve.cache.key import RadixKey, TokenArray
from radixserve.cache.radix import RadixCache
from radixserve.memory import TokenAllocator

VOCAB_SIZE = 49_152  # SmolLM2's vocabulary: token ids look like the real thing
_EMPTY: TokenArray = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload; ``timestamp``: seconds since the trace start, None = as fast as allowed."""

    prompt: TokenArray
    output: TokenArray
    extra_key: str | None = None
    timestamp: float | None = None


def _segment(rng: np.random.Generator, n: int, vocab_size: int = VOCAB_SIZE) -> TokenArray:
    # Ids 0-2 are special in both SmolLM2 and the tiny test vocabulary.
    return rng.integers(3, vocab_size, size=n, dtype=np.int64)


def _span(rng: np.random.Generator, span: tuple[int, int]) -> int:
    return int(rng.integers(span[0], span[1] + 1))


def _distinct_heads(rng: np.random.Generator, n: int, vocab_size: int) -> list[TokenArray]:
    """``n`` distinct leading tokens (token pairs, ... when the vocabulary is too small).

    Random prompts collide on their first token surprisingly often (1,000
    prompts over 49k ids: ~10 pairs), which would leak sharing into shapes
    that promise none; distinct heads make "shares nothing" exact.
    """
    base, width = vocab_size - 3, 1
    if base < 2:
        raise ValueError(f"vocab_size {vocab_size} leaves fewer than 2 ordinary tokens")
    while base**width < n:
        width += 1
    codes = rng.choice(base**width, size=n, replace=False)
    digits = np.stack([(codes // base**i) % base for i in reversed(range(width))], axis=1)
    return list(digits.astype(np.int64) + 3)


def _fresh(rng: np.random.Generator, head: TokenArray, n: int, vocab_size: int) -> TokenArray:
    """``n`` random tokens that start with ``head``."""
    return np.concatenate([head, _segment(rng, max(n - len(head), 0), vocab_size)])[:n]


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
    num_requests: int = 64,
    shared_len: int = 2000,
    suffix_len: int = 50,
    vocab_size: int = VOCAB_SIZE,
    seed: int = 0,
    num_bursts: int = 1,
    burst_interval: float = 10.0,
) -> list[TraceRequest]:
    """``num_bursts`` bursts of ``num_requests`` requests arriving together on a cold shared prefix.

    Burst k (timestamp ``k * burst_interval``) has its own ``shared_len``-token
    prefix; each request adds its own ``suffix_len`` tokens and answers 8.
    """
    rng = np.random.default_rng(seed)
    requests: list[TraceRequest] = []
    for burst in range(num_bursts):
        shared, timestamp = _segment(rng, shared_len, vocab_size), burst * burst_interval
        requests += [
            TraceRequest(
                np.concatenate([shared, _segment(rng, suffix_len, vocab_size)]),
                _segment(rng, 8, vocab_size),
                timestamp=timestamp,
            )
            for _ in range(num_requests)
        ]
    return requests


def rag(
    num_requests: int = 1000,
    num_docs: int = 200,
    system_len: int = 256,
    doc_len: tuple[int, int] = (1000, 3000),
    question_len: tuple[int, int] = (20, 80),
    output_len: tuple[int, int] = (50, 200),
    zipf_a: float = 1.1,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> list[TraceRequest]:
    """Retrieval-augmented generation: system prompt + one document + a fresh question.

    Every prompt starts with the same ``system_len`` tokens, then one of
    ``num_docs`` documents (``doc_len`` tokens; no two share a first token),
    picked by Zipf popularity: the document of rank r with probability
    proportional to 1 / r**zipf_a. Then ``question_len`` and ``output_len`` random tokens.
    """
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    rng = np.random.default_rng(seed)
    system = _segment(rng, system_len, vocab_size)
    docs = [_fresh(rng, head, _span(rng, doc_len), vocab_size) for head in _distinct_heads(rng, num_docs, vocab_size)]
    popularity = 1.0 / np.arange(1, num_docs + 1) ** zipf_a
    picks: npt.NDArray[np.int64] = rng.choice(num_docs, size=num_requests, p=popularity / popularity.sum())
    return [
        TraceRequest(
            np.concatenate([system, docs[doc], _segment(rng, _span(rng, question_len), vocab_size)]),
            _segment(rng, _span(rng, output_len), vocab_size),
        )
        for doc in picks.tolist()
    ]


def branching(
    num_trees: int = 20,
    fanout: int = 3,
    depth: int = 3,
    root_len: int = 1000,
    step_len: tuple[int, int] = (100, 300),
    output_len: tuple[int, int] = (50, 150),
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> list[TraceRequest]:
    """Tree of thought: one request per node of ``num_trees`` trees of ``depth`` levels.

    A tree has 1 + fanout + ... + fanout**(depth-1) nodes. The root's prompt is
    ``root_len`` tokens (no two trees share a first token); a child's prompt is
    its parent's prompt + the parent's output + a new ``step_len``-token step.
    Each tree is walked breadth first (parents before children) while the
    trees interleave at random, so siblings compete with other trees for the cache.
    """
    if depth < 1 or fanout < 1:
        raise ValueError(f"depth and fanout must be >= 1, got {depth}, {fanout}")
    rng = np.random.default_rng(seed)
    heads = _distinct_heads(rng, num_trees, vocab_size)
    # Per tree: nodes still to emit, as (parent prompt + output, level); level 1 is the root.
    pending = [deque([(_EMPTY, 1)]) for _ in range(num_trees)]
    active, requests = list(range(num_trees)), []
    while active:
        tree = active[int(rng.integers(len(active)))]
        context, level = pending[tree].popleft()
        if level == 1:
            prompt = _fresh(rng, heads[tree], root_len, vocab_size)
        else:
            prompt = np.concatenate([context, _segment(rng, _span(rng, step_len), vocab_size)])
        output = _segment(rng, _span(rng, output_len), vocab_size)
        requests.append(TraceRequest(prompt, output))
        if level < depth:
            pending[tree].extend([(np.concatenate([prompt, output]), level + 1)] * fanout)
        if not pending[tree]:
            active.remove(tree)
    return requests


def generated_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    grouped: bool = False,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> list[TraceRequest]:
    """The shape of SGLang's ``bench_serving --dataset-name generated-shared-prefix``.

    ``num_groups`` x ``prompts_per_group`` requests. A prompt is its group's
    system prompt (exactly ``system_prompt_len`` tokens) + a question of
    exactly ``question_len`` tokens; the output is exactly ``output_len``
    tokens. Prompts of one group share exactly the system prompt, prompts of
    different groups nothing (distinct first tokens; with a vocabulary smaller
    than the counts, at most a token or two). Requests arrive with the groups
    shuffled together, so similar requests meet only if a scheduler reorders
    them; ``grouped=True`` keeps each group's requests together instead.
    """
    rng = np.random.default_rng(seed)
    heads = _distinct_heads(rng, num_groups, vocab_size)
    requests = [
        TraceRequest(
            np.concatenate([system, _fresh(rng, question_head, question_len, vocab_size)]),
            _segment(rng, output_len, vocab_size),
        )
        for system in [_fresh(rng, head, system_prompt_len, vocab_size) for head in heads]
        for question_head in _distinct_heads(rng, prompts_per_group, vocab_size)
    ]
    return requests if grouped else [requests[i] for i in rng.permutation(len(requests))]


def no_sharing(
    num_requests: int = 1000,
    prompt_len: tuple[int, int] = (500, 2500),
    output_len: tuple[int, int] = (50, 200),
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> list[TraceRequest]:
    """The control: ``prompt_len``-token prompts that share nothing (distinct first tokens).

    With more requests than ordinary token ids, the first two tokens are
    distinct instead (a shared prefix of at most one token).
    """
    rng = np.random.default_rng(seed)
    return [
        TraceRequest(
            _fresh(rng, head, _span(rng, prompt_len), vocab_size), _segment(rng, _span(rng, output_len), vocab_size)
        )
        for head in _distinct_heads(rng, num_requests, vocab_size)
    ]


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "support-agent": support_agent,
    "fewshot-burst": fewshot_burst,
    "rag": rag,
    "branching": branching,
    "generated-shared-prefix": generated_shared_prefix,
    "no-sharing": no_sharing,
}

# How make_workload scales each workload: the size parameter it sets, and how
# many requests one unit of that parameter makes (given the other parameters).
_SIZES: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "support-agent": ("num_users", lambda p: int(p["turns_per_user"])),
    "fewshot-burst": ("num_requests", lambda p: int(p["num_bursts"])),
    "rag": ("num_requests", lambda p: 1),
    "branching": ("num_trees", lambda p: sum(int(p["fanout"]) ** i for i in range(int(p["depth"])))),
    "generated-shared-prefix": ("num_groups", lambda p: int(p["prompts_per_group"])),
    "no-sharing": ("num_requests", lambda p: 1),
}


def make_workload(
    name: str, num_requests: int | None = None, seed: int = 0, vocab_size: int = VOCAB_SIZE, **overrides: Any
) -> list[TraceRequest]:
    """The workload ``name`` with about ``num_requests`` requests (None: the generator's defaults).

    The size is set through one parameter, rounded up to whole units:
    support-agent ``num_users`` (x turns_per_user), fewshot-burst
    ``num_requests`` per burst (x num_bursts), branching ``num_trees`` (x nodes
    per tree), generated-shared-prefix ``num_groups`` (x prompts_per_group),
    rag and no-sharing ``num_requests``. ``overrides`` go to the generator
    unchanged; an unknown one is a TypeError there, never ignored.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    generator = WORKLOADS[name]
    if num_requests is not None:
        size_param, per_unit = _SIZES[name]
        if num_requests < 0 or size_param in overrides:
            raise ValueError(f"num_requests must be >= 0 and not given together with {size_param}")
        params = {k: p.default for k, p in inspect.signature(generator).parameters.items()} | overrides
        overrides[size_param] = -(-num_requests // per_unit(params))
    return generator(seed=seed, vocab_size=vocab_size, **overrides)


# ---- trace files ---------------------------------------------------------------------------


def load_trace(
    path: str | os.PathLike[str], block_size: int = 512, vocab_size: int = VOCAB_SIZE, limit: int | None = None
) -> list[TraceRequest]:
    """Requests from a Mooncake-style JSONL trace (at most ``limit``); blank lines are skipped.

    A line is ``{"timestamp": ms, "input_length": n, "output_length": m,
    "hash_ids": [...]}``: hash id h stands for ``block_size`` pseudo-random
    tokens seeded by h alone, so equal ids are equal blocks on every line (the
    trace's prefix sharing survives); the blocks are concatenated and cut to
    ``input_length``. A line may give ``"input_ids"`` instead of hash ids, and
    an ``"extra_key"``. The output is ``output_length`` tokens seeded by the
    line number. A malformed line raises ValueError naming it.
    """
    blocks: dict[int, TokenArray] = {}  # a trace reuses its blocks: build each once
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                requests.append(_parse_line(json.loads(line), lineno, block_size, vocab_size, blocks))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{os.fspath(path)}:{lineno}: malformed trace line: {e!r}") from e
    return requests


def _parse_line(
    record: Any, lineno: int, block_size: int, vocab_size: int, blocks: dict[int, TokenArray]
) -> TraceRequest:
    if not isinstance(record, dict):
        raise TypeError(f"expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        prompt = _int_array(record["input_ids"])
        if record.get("input_length", len(prompt)) != len(prompt):
            raise ValueError(f"input_length {record['input_length']} != {len(prompt)} input_ids")
    else:
        input_len, hash_ids = _count(record["input_length"]), _int_array(record["hash_ids"]).tolist()
        num_blocks = -(-input_len // block_size)
        if len(hash_ids) < num_blocks or min(hash_ids, default=0) < 0:
            raise ValueError(f"need {num_blocks} non-negative hash_ids for input_length {input_len}")
        for h in hash_ids[:num_blocks]:
            if h not in blocks:
                blocks[h] = _segment(np.random.default_rng((0, h)), block_size, vocab_size)
        prompt = np.concatenate([blocks[h] for h in hash_ids[:num_blocks]] or [_EMPTY])[:input_len]
    output = _segment(np.random.default_rng((1, lineno)), _count(record["output_length"]), vocab_size)
    timestamp, extra_key = record.get("timestamp"), record.get("extra_key")
    if not (timestamp is None or isinstance(timestamp, (int, float))) or isinstance(timestamp, bool):
        raise TypeError(f"timestamp must be a number of ms, got {timestamp!r}")
    if not (extra_key is None or isinstance(extra_key, str)):
        raise TypeError(f"extra_key must be a string, got {extra_key!r}")
    return TraceRequest(prompt, output, extra_key, None if timestamp is None else timestamp / 1000)


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _int_array(values: Any) -> TokenArray:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError("expected a list of integers")
    return np.array(values, dtype=np.int64)


def save_trace(requests: Sequence[TraceRequest], path: str | os.PathLike[str]) -> None:
    """Write ``requests`` as JSONL that ``load_trace`` reads back.

    Prompts, output lengths, namespaces and timestamps (ms) round-trip; the
    output tokens do not (a trace records lengths only), they are regenerated.
    """
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            record: dict[str, Any] = {} if request.timestamp is None else {"timestamp": request.timestamp * 1000}
            record |= {"input_length": len(request.prompt), "input_ids": request.prompt.tolist()}
            record["output_length"] = len(request.output)
            if request.extra_key is not None:
                record["extra_key"] = request.extra_key
            f.write(json.dumps(record) + "\n")


def with_poisson_arrivals(requests: Sequence[TraceRequest], rate: float, seed: int = 0) -> list[TraceRequest]:
    """Copies of ``requests`` arriving as a Poisson process of ``rate`` requests/s.

    The first arrives at 0.0, the gaps are exponential; ``rate=inf`` sends all at 0.0.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        times = np.zeros(len(requests))
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(requests))
        times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return [dataclasses.replace(r, timestamp=float(t)) for r, t in zip(requests, times)]


# ---- text prompts ----------------------------------------------------------------------------

# 20 consonants x 5 vowels: one syllable per base-100 digit of a token id.
_SYLLABLES = tuple(c + v for c in "bcdfghjklmnprstvwxyz" for v in "aeiou")


def text_of(tokens: TokenArray | Sequence[int]) -> str:
    """The prompt as pseudo-words, one per token id, joined by single spaces.

    For servers with another tokenizer: id 4711 -> "mide" (base-100 digits 47,
    11 as syllables). Injective: different ids give different words, so equal
    token prefixes give equal text prefixes and nothing else does. A real
    tokenizer splits a pseudo-word into a few tokens: the sharing structure is
    kept, token counts scale by that factor.
    """
    return " ".join(map(_word, np.asarray(tokens, dtype=np.int64).reshape(-1).tolist()))


@functools.lru_cache(maxsize=1 << 16)
def _word(token: int) -> str:
    if token < 0:
        raise ValueError(f"token ids are non-negative, got {token}")
    syllables = []
    while True:
        token, digit = divmod(token, 100)
        syllables.append(_SYLLABLES[digit])
        if not token:
            return "".join(reversed(syllables))


# ---- working set -----------------------------------------------------------------------------


def working_set_tokens(requests: Sequence[TraceRequest]) -> int:
    """Distinct token positions over every prompt + output (per namespace).

    The cache capacity that would hold the whole workload: a prefix shared by
    many requests counts once. Measured with our own RadixCache over a pool
    big enough for everything, so it is exactly what the tree would hold.
    """
    total_len = sum(len(r.prompt) + len(r.output) for r in requests)
    if not total_len:
        return 0
    cache = RadixCache(TokenAllocator(total_len))
    for request in requests:
        key = RadixKey(np.concatenate([request.prompt, request.output]), request.extra_key)
        cached = cache.match_prefix(key).indices
        fresh = cache.allocator.alloc(len(key) - len(cached))
        assert fresh is not None  # the pool holds every token of every request
        cache.insert(key, np.concatenate([cached, fresh]))
    return cache.total_size()
