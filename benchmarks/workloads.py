"""Seeded, token-level workloads the benchmarks replay (trace files and the rest: ``traces.py``).

A workload is a list of ``TraceRequest``: the prompt tokens, the tokens the
model will answer with (so a replay can cache the whole conversation turn),
an optional namespace and an optional arrival time. Same seed, same tokens, on
every machine (for one numpy version: numpy does not promise its Generator
streams across releases).

The generators (``WORKLOADS``, ``make_workload``) build the shapes DESIGN.md
names. ``traces.py`` holds the tools around them: trace files, arrival times,
text prompts, the working-set size.

Length ranges such as ``doc_len=(1000, 3000)`` are inclusive at both ends.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from radixserve.cache.core.key import TokenArray

VOCAB_SIZE = 49_152  # SmolLM2's vocabulary: token ids look like the real thing
_EMPTY: TokenArray = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload; ``timestamp``: seconds since the trace start, None = as fast as allowed."""

    prompt: TokenArray
    output: TokenArray
    extra_key: str | None = None
    timestamp: float | None = None
    # A closed loop (agent-loop): turn ``turn`` of session ``session`` is sent once the session's previous turn
    # has been answered, as an agent sends its next call once the tool result is in.
    session: int | None = None
    turn: int = 0


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int = VOCAB_SIZE) -> TokenArray:
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
    return np.concatenate([head, random_tokens(rng, max(n - len(head), 0), vocab_size)])[:n]


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
    preamble = np.concatenate([random_tokens(rng, system_len, vocab_size), random_tokens(rng, fewshot_len, vocab_size)])
    histories = [preamble] * num_users
    turns_left = [turns_per_user] * num_users
    requests: list[TraceRequest] = []
    active = list(range(num_users))
    while active:
        user = active[int(rng.integers(len(active)))]
        message = random_tokens(rng, int(rng.integers(20, 120)), vocab_size)
        reply = random_tokens(rng, int(rng.integers(50, 300)), vocab_size)
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
        shared, timestamp = random_tokens(rng, shared_len, vocab_size), burst * burst_interval
        requests += [
            TraceRequest(
                np.concatenate([shared, random_tokens(rng, suffix_len, vocab_size)]),
                random_tokens(rng, 8, vocab_size),
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
    shift_at: float | None = None,
) -> list[TraceRequest]:
    """Retrieval-augmented generation: system prompt + one document + a fresh question.

    Every prompt starts with the same ``system_len`` tokens, then one of
    ``num_docs`` documents (``doc_len`` tokens; no two share a first token),
    picked by Zipf popularity: the document of rank r with probability
    proportional to 1 / r**zipf_a. Then ``question_len`` and ``output_len`` random tokens.
    ``shift_at``: from that fraction of the requests on, the ranking is reversed
    (the hot documents go cold and the coldest become hot): where counts of past
    hits go stale.
    """
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    rng = np.random.default_rng(seed)
    system = random_tokens(rng, system_len, vocab_size)
    docs = [_fresh(rng, head, _span(rng, doc_len), vocab_size) for head in _distinct_heads(rng, num_docs, vocab_size)]
    popularity = 1.0 / np.arange(1, num_docs + 1) ** zipf_a
    picks: npt.NDArray[np.int64] = rng.choice(num_docs, size=num_requests, p=popularity / popularity.sum())
    if shift_at is not None:
        first = int(num_requests * shift_at)
        picks[first:] = num_docs - 1 - picks[first:]
    return [
        TraceRequest(
            np.concatenate([system, docs[doc], random_tokens(rng, _span(rng, question_len), vocab_size)]),
            random_tokens(rng, _span(rng, output_len), vocab_size),
        )
        for doc in picks.tolist()
    ]


def rag_shift(num_requests: int = 1000, shift_at: float = 0.5, **params: Any) -> list[TraceRequest]:
    """``rag`` whose popularity flips at ``shift_at`` (halfway): the hot documents change."""
    return rag(num_requests=num_requests, shift_at=shift_at, **params)


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
            prompt = np.concatenate([context, random_tokens(rng, _span(rng, step_len), vocab_size)])
        output = random_tokens(rng, _span(rng, output_len), vocab_size)
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
            random_tokens(rng, output_len, vocab_size),
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
            _fresh(rng, head, _span(rng, prompt_len), vocab_size),
            random_tokens(rng, _span(rng, output_len), vocab_size),
        )
        for head in _distinct_heads(rng, num_requests, vocab_size)
    ]


def chat_and_one_offs(num_users: int = 84, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[TraceRequest]:
    """``support_agent`` turns and as many ``no_sharing`` prompts, taking turns: chat beside unrelated prompts.

    The one-off prompts sit at the top of the radix tree and are never reused;
    the conversations' reused turns sit deep below the shared preamble. A
    policy that ranked every leaf by depth would keep the wrong ones here
    (why ``adaptive`` weighs the top level by recency, cache/adaptive/candidates.py).
    """
    chats = support_agent(num_users=num_users, seed=seed, vocab_size=vocab_size)
    one_offs = no_sharing(num_requests=len(chats), seed=seed + 1, vocab_size=vocab_size)
    return [r for pair in zip(chats, one_offs, strict=True) for r in pair]


def agent_loop(
    num_agents: int = 32,
    turns: int = 6,
    system_len: int = 400,
    tools_len: int = 800,
    task_len: tuple[int, int] = (30, 80),
    call_len: tuple[int, int] = (20, 60),
    result_len: tuple[int, int] = (50, 300),
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> list[TraceRequest]:
    """Tool-calling agents: a system prompt and tool schemas every agent shares, then each agent's task.

    Turn t's prompt is the preamble, the task, and every earlier turn's tool call (the model's answer) and
    tool result; it answers with its next call. So turn t+1 adds only a call and a result to turn t's
    prompt: a cache that keeps the conversation prefills just those. Sessions: one per agent (closed loop).
    """
    rng = np.random.default_rng(seed)
    preamble = np.concatenate([random_tokens(rng, system_len, vocab_size), random_tokens(rng, tools_len, vocab_size)])
    requests: list[TraceRequest] = []
    for agent in range(num_agents):
        prompt = np.concatenate([preamble, random_tokens(rng, _span(rng, task_len), vocab_size)])
        for turn in range(turns):
            call = random_tokens(rng, _span(rng, call_len), vocab_size)
            requests.append(TraceRequest(prompt, call, session=agent, turn=turn))
            prompt = np.concatenate([prompt, call, random_tokens(rng, _span(rng, result_len), vocab_size)])
    return requests


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "support-agent": support_agent,
    "fewshot-burst": fewshot_burst,
    "rag": rag,
    "rag-shift": rag_shift,
    "branching": branching,
    "generated-shared-prefix": generated_shared_prefix,
    "no-sharing": no_sharing,
    "chat-and-one-offs": chat_and_one_offs,
    "agent-loop": agent_loop,
}

# How make_workload scales each workload: the size parameter it sets, and how
# many requests one unit of that parameter makes (given the other parameters).
_SIZES: dict[str, tuple[str, Callable[[dict[str, Any]], int]]] = {
    "support-agent": ("num_users", lambda p: int(p["turns_per_user"])),
    "fewshot-burst": ("num_requests", lambda p: int(p["num_bursts"])),
    "rag": ("num_requests", lambda p: 1),
    "rag-shift": ("num_requests", lambda p: 1),
    "branching": ("num_trees", lambda p: sum(int(p["fanout"]) ** i for i in range(int(p["depth"])))),
    "generated-shared-prefix": ("num_groups", lambda p: int(p["prompts_per_group"])),
    "no-sharing": ("num_requests", lambda p: 1),
    "chat-and-one-offs": ("num_users", lambda p: 12),  # 6 turns a user, each beside a one-off prompt
    "agent-loop": ("num_agents", lambda p: int(p["turns"])),
}


def make_workload(
    name: str, num_requests: int | None = None, seed: int = 0, vocab_size: int = VOCAB_SIZE, **overrides: Any
) -> list[TraceRequest]:
    """The workload ``name`` with about ``num_requests`` requests (None: the generator's defaults).

    The size is set through one parameter, rounded up to whole units:
    support-agent ``num_users`` (x turns_per_user), fewshot-burst
    ``num_requests`` per burst (x num_bursts), branching ``num_trees`` (x nodes
    per tree), generated-shared-prefix ``num_groups`` (x prompts_per_group),
    rag and no-sharing ``num_requests``, chat-and-one-offs ``num_users`` (x 12), agent-loop ``num_agents``
    (x turns). ``overrides`` go to the generator
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
