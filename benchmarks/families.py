"""Randomised workload families: each seed draws a generator's parameters from ranges, then its requests.

A policy tuned on a handful of fixed workloads can win on them and lose on their neighbours. Here every seed
of a family is a different workload: chat (support-agent: users in flight = how long a conversation's turns
are apart, turns, preamble lengths), rag (documents, their lengths, Zipf skew, questions), branching (tree of
thought: fanout, depth, root and step lengths), shared-prefix (groups, prompts per group, prefix and question
lengths), agent (tool-calling loops: agents, turns, tool results), and mixed (chat turns beside unrelated
one-off prompts). Arrival times are Poisson at a drawn rate, so a replay on the trace clock shows time-aware
policies gaps that vary. ``TUNING_SEEDS`` are the seeds a policy's constants may be tuned on; a report uses
``HELD_OUT_SEEDS`` and quotes the worst seed, not the mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.traces import with_poisson_arrivals
from benchmarks.workloads import TraceRequest, make_workload

TUNING_SEEDS = tuple(range(0, 8))
HELD_OUT_SEEDS = tuple(range(1000, 1020))


def _between(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high + 1))


def _span(rng: np.random.Generator, low: int, high: int) -> tuple[int, int]:
    a = _between(rng, low, high)
    return a, _between(rng, a, high)


def _chat(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    return "support-agent", {
        "num_users": _between(rng, 20, 120),
        "turns_per_user": _between(rng, 2, 10),
        "system_len": _between(rng, 50, 800),
        "fewshot_len": _between(rng, 0, 2000),
    }


def _rag(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    return "rag", {
        "num_requests": _between(rng, 300, 800),
        "num_docs": _between(rng, 20, 400),
        "doc_len": _span(rng, 200, 3000),
        "question_len": _span(rng, 10, 200),
        "zipf_a": float(rng.uniform(0.6, 1.6)),
        "system_len": _between(rng, 0, 500),
    }


def _branching(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    fanout, depth = _between(rng, 2, 4), _between(rng, 2, 4)
    nodes = sum(fanout**level for level in range(depth))
    return "branching", {
        "num_trees": max(600 // nodes, 4),
        "fanout": fanout,
        "depth": depth,
        "root_len": _between(rng, 100, 2000),
        "step_len": _span(rng, 20, 400),
        "output_len": _span(rng, 20, 200),
    }


def _shared_prefix(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    return "generated-shared-prefix", {
        "num_groups": _between(rng, 8, 80),
        "prompts_per_group": _between(rng, 4, 24),
        "system_prompt_len": _between(rng, 100, 2500),
        "question_len": _between(rng, 20, 300),
        "output_len": _between(rng, 20, 300),
    }


def _agent(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    return "agent-loop", {
        "num_agents": _between(rng, 16, 96),
        "turns": _between(rng, 3, 10),
        "system_len": _between(rng, 50, 800),
        "tools_len": _between(rng, 0, 1500),
        "result_len": _span(rng, 20, 500),
    }


def _mixed(rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
    return "chat-and-one-offs", {"num_users": _between(rng, 20, 80)}


FAMILIES: dict[str, Callable[[np.random.Generator], tuple[str, dict[str, Any]]]] = {
    "chat": _chat,
    "rag": _rag,
    "branching": _branching,
    "shared-prefix": _shared_prefix,
    "agent": _agent,
    "mixed": _mixed,
}


def draw(family: str, seed: int) -> tuple[dict[str, Any], list[TraceRequest]]:
    """The parameters seed ``seed`` draws for ``family`` and the workload they make, with Poisson arrivals."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    rng = np.random.default_rng((hash_name(family), seed))
    name, params = FAMILIES[family](rng)
    rate = float(rng.uniform(0.5, 20.0))  # requests per second: how far apart in time turns and reuses fall
    requests = make_workload(name, seed=seed, **params)
    return params | {"rate": round(rate, 2)}, with_poisson_arrivals(requests, rate, seed)


def hash_name(name: str) -> int:
    """A stable integer for a family's name (Python's hash() of a str changes per process)."""
    return int.from_bytes(name.encode(), "little") % (1 << 32)
