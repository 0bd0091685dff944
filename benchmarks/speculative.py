"""Speculative decoding (``--speculative-algorithm ngram``) against plain decoding, side by side in one run.

``radixserve bench speculative``: the embedded SmolLM2 (or ``--model-path``), greedy, ``--threads`` threads
(1 by default). One engine; each configuration swaps the scheduler's drafter (off | both | tree | prompt), so
every one runs the same model and kernels, and greedy answers must come out the same (checked: the run stops
if one differs). Rounds rotate the configurations' order so load on the machine hits them alike; the table
gives each figure's median over rounds.

Workloads (chat prompts):
- code-edit: a Python file in the prompt, the answer rewrites it with one rename (copies most of it);
- rag-quote: a document in the prompt, the answer quotes from it;
- agent: turns of one tool-calling agent, one request each (no history in the prompt), the same JSON shape
  every turn: earlier answers are in the prefix cache (tree drafts) but not in the prompt (prompt lookup);
- prose: free stories (nothing to copy: drafting must not cost);
- prose-x16: 16 prose requests at once, aggregate output tok/s (large batches must not lose).

Single-stream figures are decode tok/s: a request's output tokens after its first, over the time from its
first token to its last (prefill excluded); x16 is every output token over the batch's wall time. Beside the
times, a figure load cannot move: decode forwards per output token (1.0 without drafts; each verify step is one
forward however many tokens it takes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

from radixserve.engine import Engine
from radixserve.scheduler.draft import Drafter
from radixserve.scheduler.request import Request

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The total length the intervals cover, counting overlaps once."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
DOC = (
    "The Harbor Bridge opened in 1932 after eight years of construction. It carries eight lanes of traffic, "
    "two railway lines and a footway. The arch spans 503 metres and its top stands 134 metres above the water. "
    "About 160,000 vehicles cross it every day. Workers repaint it continuously; a full coat takes ten years. "
    "In 1998 a climbing tour opened, and more than four million people have climbed the arch since then. "
    "The bridge was designed by John Bradfield, who oversaw the project from its first survey to its opening."
)
QUESTIONS = ["How long is the arch?", "Who designed the bridge?", "How many vehicles cross it?", "When did it open?"]
AGENT_SYSTEM = "You are a weather assistant. Call the get_weather tool for the city the user asks about."
# The call's JSON is held to this schema (structured output) and is nowhere in the prompt: drafts of its shape
# come from earlier turns' answers in the prefix cache (tree), not from the request's own text (prompt).
AGENT_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "tool": {"type": "string", "enum": ["get_weather"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                    "include_hourly_forecast": {"type": "boolean"},
                },
                "required": ["city", "unit", "days", "include_hourly_forecast"],
            },
        },
        "required": ["tool", "arguments"],
    }
)
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome"]
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a market at dawn", "an old violin", "a comet"]

Workload = list[list[dict[str, str]]]


def workloads() -> dict[str, Workload]:
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    return {
        "code-edit": [
            user(f"Rewrite this code, renaming `intervals` to `{name}`. Output only the code.\n\n{CODE}")
            for name in ("spans", "ranges")
        ],
        "rag-quote": [user(f"{DOC}\n\nQuote the sentence that answers: {q}") for q in QUESTIONS[:2]],
        "agent": [
            [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": f"Weather in {city}?"}]
            for city in CITIES[:6]
        ],
        "prose": [user(f"Write a short story about {topic}.") for topic in TOPICS[:2]],
    }


Result = tuple[float, float, list[list[int]]]  # (tok/s, decode forwards per output token, the answers)


def decode_speed(reqs: list[Request]) -> float:
    """Output tokens after the first, over first token to finish, summed over the requests run one at a time."""
    tokens = sum(len(r.output_ids) - 1 for r in reqs)
    seconds = sum((r.finish_time or 0.0) - (r.first_token_time or 0.0) for r in reqs)
    return tokens / seconds if seconds > 0 else 0.0


def forwards_per_token(reqs: list[Request]) -> float:
    """Decode forwards per decoded token: each step takes one token, plus the drafts it accepted."""
    tokens = sum(len(r.output_ids) - 1 for r in reqs)
    accepted = sum(r.spec.num_accepted_tokens for r in reqs if r.spec is not None)
    return (tokens - accepted) / tokens if tokens else 1.0


def run_sequential(engine: Engine, prompts: Workload, max_new_tokens: int, schema: str | None = None) -> Result:
    """One request at a time (each sees the cache the earlier ones left); decode tok/s and the answers."""
    reqs = []
    for messages in prompts:
        params = {**_params(max_new_tokens), **({"json_schema": schema} if schema else {})}
        req = engine.make_request(engine.tokenizer.apply_chat_template(messages), params)
        engine.run_until_done([req])
        reqs.append(req)
    return decode_speed(reqs), forwards_per_token(reqs), [r.output_ids for r in reqs]


def run_batch(engine: Engine, prompts: Workload, max_new_tokens: int) -> Result:
    """All at once: aggregate output tok/s over the wall time, and the answers."""
    reqs = [engine.make_request(engine.tokenizer.apply_chat_template(m), _params(max_new_tokens)) for m in prompts]
    began = time.perf_counter()
    engine.run_until_done(reqs)
    speed = sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - began)
    return speed, forwards_per_token(reqs), [r.output_ids for r in reqs]


def _params(max_new_tokens: int) -> dict[str, object]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0}


def drafters(engine: Engine, num: int) -> dict[str, Drafter | None]:
    """The configurations: the engine's own drafter over its index (both sources), each source alone, off."""
    both = engine.drafter
    assert both is not None and both.index is not None
    return {
        "off": None,
        "both": both,
        "tree": Drafter(num, both.index, use_prompt=False),
        "prompt": Drafter(num, None, use_prompt=True),
    }


def measure(
    engine: Engine, configs: dict[str, Drafter | None], run: Callable[[], Result]
) -> dict[str, tuple[float, float]]:
    """Each configuration once on a cold cache (order as given); (tok/s, forwards per token) by configuration.
    Greedy answers agree."""
    speeds, answers = {}, {}
    for name, drafter in configs.items():
        engine.scheduler.drafter = drafter
        engine.flush_cache()
        speed, forwards, answers[name] = run()
        speeds[name] = speed, forwards
    first = next(iter(answers.values()))
    for name, out in answers.items():
        if out != first:
            raise AssertionError(f"greedy answers differ with drafts ({name}): speculative decoding changed an answer")
    return speeds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--workloads", nargs="*", default=None, help="run only these (default: all)")
    args = parser.parse_args(argv)
    engine = Engine(
        model_path=args.model_path,
        num_threads=args.threads,
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=args.num_draft_tokens,
    )
    configs = drafters(engine, args.num_draft_tokens)
    table: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for round_ in range(args.rounds):
        for name, prompts in workloads().items():
            if args.workloads is not None and name not in args.workloads:
                continue
            chosen = configs if name == "agent" else {k: configs[k] for k in ("off", "both")}
            order = dict(list(chosen.items())[round_ % len(chosen) :] + list(chosen.items())[: round_ % len(chosen)])
            schema = AGENT_SCHEMA if name == "agent" else None
            speeds = measure(engine, order, partial(run_sequential, engine, prompts, args.max_new_tokens, schema))
            for config, speed in speeds.items():
                table.setdefault(name, {}).setdefault(config, []).append(speed)
        if args.workloads is None or "prose-x16" in args.workloads:
            batch = [m for m in workloads()["prose"] for _ in range(8)]  # 16 requests at once
            both = {k: configs[k] for k in (("off", "both") if round_ % 2 == 0 else ("both", "off"))}
            speeds = measure(engine, both, partial(run_batch, engine, batch, args.max_new_tokens // 2))
            for config, speed in speeds.items():
                table.setdefault("prose-x16", {}).setdefault(config, []).append(speed)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print_table(table)
    engine.close()


def print_table(table: dict[str, dict[str, list[tuple[float, float]]]]) -> None:
    """Medians over rounds: tok/s, and (in brackets) decode forwards per output token."""
    print("| workload | off tok/s | both tok/s | both / off | tree tok/s | prompt tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, by_config in table.items():
        speed = {config: statistics.median(v[0] for v in values) for config, values in by_config.items()}
        forwards = {config: statistics.median(v[1] for v in values) for config, values in by_config.items()}
        cells = {c: f"{speed[c]:.1f} ({forwards[c]:.2f})" for c in speed}
        ratio = speed["both"] / speed["off"]
        extra = " | ".join(cells.get(c, "") for c in ("tree", "prompt"))
        print(f"| {name} | {cells['off']} | {cells['both']} | {ratio:.2f}x | {extra} |")
