"""The tools around workloads: trace files, arrival times, text prompts, the working-set size.

- ``load_trace`` / ``save_trace``: Mooncake-style JSONL (hash ids of 512-token blocks, or token ids);
- ``load_scaled_trace`` / ``time_slice``: a production trace (Mooncake's FAST'25 release) scaled down for a
  replay, and the first or second half of it by time (tune on one, report on the other);
- ``with_poisson_arrivals``: open-loop arrival times for a serving benchmark;
- ``text_of``: the same structure as text, for servers with their own tokenizer;
- ``working_set_tokens``: the cache capacity that holds a whole workload.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.workloads import VOCAB_SIZE, TraceRequest, random_tokens
from radixserve.cache.core.key import RadixKey, TokenArray
from radixserve.cache.core.radix import RadixCache
from radixserve.memory import TokenAllocator

# ---- trace files ---------------------------------------------------------------------------


def load_trace(
    path: str | os.PathLike[str],
    block_size: int = 512,
    vocab_size: int = VOCAB_SIZE,
    limit: int | None = None,
    input_scale: tuple[int, int] = (1, 1),
) -> list[TraceRequest]:
    """Requests from a Mooncake-style JSONL trace (at most ``limit``); blank lines are skipped.

    A line is ``{"timestamp": ms, "input_length": n, "output_length": m,
    "hash_ids": [...]}``: hash id h stands for ``block_size`` pseudo-random
    tokens seeded by h alone, so equal ids are equal blocks on every line (the
    trace's prefix sharing survives); the blocks are concatenated and cut to
    ``input_length``. A line may give ``"input_ids"`` instead of hash ids, and
    an ``"extra_key"``. The output is ``output_length`` tokens seeded by the
    line number. A malformed line raises ValueError naming it. ``input_scale`` (a, b): a hash-id
    line's ``input_length`` counts as ceil(input_length * a / b) (``load_scaled_trace``).
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
                record = json.loads(line)
                requests.append(_parse_line(record, lineno, block_size, vocab_size, blocks, input_scale))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{os.fspath(path)}:{lineno}: malformed trace line: {e!r}") from e
    return requests


def load_scaled_trace(
    path: str | os.PathLike[str], block_tokens: int = 32, block_size: int = 512, limit: int | None = None
) -> list[TraceRequest]:
    """A Mooncake trace with each ``block_size``-token block scaled to ``block_tokens`` tokens, prompts only.

    ``bench simulate --trace mooncake:PATH``: a production trace's prefix sharing at 1/16 of its
    length (the default), so a Python replay of every request takes seconds. A prompt of n tokens
    becomes ceil(n * block_tokens / block_size) tokens of its scaled blocks. The outputs are dropped:
    a turn's answer reaches the next turn as that turn's own hash ids (the prompt's partial last
    block and the answer hash to new blocks), so caching tokens drawn for it could never be matched.
    Timestamps (s) are kept: the replay's clock.
    """
    if not 0 < block_tokens <= block_size:
        raise ValueError(f"block_tokens must be in [1, {block_size}], got {block_tokens}")
    requests = []
    for request in load_trace(path, block_tokens, limit=limit, input_scale=(block_tokens, block_size)):
        requests.append(dataclasses.replace(request, output=request.output[:0]))
    return requests


def time_slice(requests: Sequence[TraceRequest], part: str) -> list[TraceRequest]:
    """``all``, or the requests before (``first-half``) or from (``second-half``) the midpoint of the
    trace's time span: tune on the first half, report on the second, which the tuning never saw."""
    if part == "all":
        return list(requests)
    if part not in ("first-half", "second-half"):
        raise ValueError(f"time slice must be all, first-half or second-half, got {part!r}")
    times = [r.timestamp for r in requests]
    if any(t is None for t in times):
        raise ValueError("a time slice needs a timestamp on every request")
    middle = (min(times) + max(times)) / 2  # type: ignore[type-var, operator]
    first = part == "first-half"
    return [r for r, t in zip(requests, times) if (t < middle) == first]  # type: ignore[operator]


def _parse_line(
    record: Any,
    lineno: int,
    block_size: int,
    vocab_size: int,
    blocks: dict[int, TokenArray],
    input_scale: tuple[int, int] = (1, 1),
) -> TraceRequest:
    if not isinstance(record, dict):
        raise TypeError(f"expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        prompt = _int_array(record["input_ids"])
        if record.get("input_length", len(prompt)) != len(prompt):
            raise ValueError(f"input_length {record['input_length']} != {len(prompt)} input_ids")
    else:
        input_len, hash_ids = _count(record["input_length"]), _int_array(record["hash_ids"]).tolist()
        input_len = -(-input_len * input_scale[0] // input_scale[1])
        num_blocks = -(-input_len // block_size)
        if len(hash_ids) < num_blocks or min(hash_ids, default=0) < 0:
            raise ValueError(f"need {num_blocks} non-negative hash_ids for input_length {input_len}")
        for h in hash_ids[:num_blocks]:
            if h not in blocks:
                blocks[h] = random_tokens(np.random.default_rng((0, h)), block_size, vocab_size)
        prompt = np.concatenate([blocks[h] for h in hash_ids[:num_blocks]] or [np.empty(0, dtype=np.int64)])[:input_len]
    output = random_tokens(np.random.default_rng((1, lineno)), _count(record["output_length"]), vocab_size)
    timestamp, extra_key = record.get("timestamp"), record.get("extra_key")
    if not (timestamp is None or isinstance(timestamp, (int, float))) or isinstance(timestamp, bool):
        raise TypeError(f"timestamp must be a number of ms, got {timestamp!r}")
    if not (extra_key is None or isinstance(extra_key, str)):
        raise TypeError(f"extra_key must be a string, got {extra_key!r}")
    session = None if record.get("session") is None else _count(record["session"])
    turn = _count(record.get("turn", 0))
    return TraceRequest(prompt, output, extra_key, None if timestamp is None else timestamp / 1000, session, turn)


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

    Prompts, output lengths, namespaces, timestamps (ms) and sessions' turns round-trip; the
    output tokens do not (a trace records lengths only), they are regenerated.
    """
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            record: dict[str, Any] = {} if request.timestamp is None else {"timestamp": request.timestamp * 1000}
            record |= {"input_length": len(request.prompt), "input_ids": request.prompt.tolist()}
            record["output_length"] = len(request.output)
            if request.extra_key is not None:
                record["extra_key"] = request.extra_key
            if request.session is not None:  # a closed-loop session's turn (agent-loop)
                record |= {"session": request.session, "turn": request.turn}
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
