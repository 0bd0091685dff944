"""Speculative decoding (``--speculative-algorithm ngram``) against plain decoding, side by side in one run.

``radixserve bench speculative``: the embedded SmolLM2 (or ``--model-path``), greedy, ``--threads`` threads
(1 by default). One engine; each configuration swaps the scheduler's drafter (off | both | tree | prompt), so
every one runs the same model and kernels, and greedy answers must come out the same (checked: the run stops
if one differs). Rounds rotate the configurations' order so load on the machine hits them alike; the table
gives each figure's median over rounds.

Workloads (chat prompts, ``copy_workloads.py``; the same ones ``bench serve --servers`` sends through HTTP):
code-edit, code-edit-class, rag-quote, agent (tree and prompt drafts also alone), prose, and prose-x16: 16 prose
requests at once, aggregate output tok/s (large batches must not lose).

Single-stream figures are decode tok/s: a request's output tokens after its first, over the time from its
first token to its last (prefill excluded); x16 is every output token over the batch's wall time. Beside the
times, a figure load cannot move: decode forwards per output token (1.0 without drafts; each verify step is one
forward however many tokens it takes), and its bound for drafts from context (``context_bound``): the fewest
forwards any drafter of up to ``--num-draft-tokens`` tokens could reach by copying from what the cache holds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

from benchmarks.copy_workloads import SCHEMAS, Workload, repeated, workloads
from radixserve.engine import Engine
from radixserve.scheduler.draft import Drafter
from radixserve.scheduler.request import Request

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


def context_bound(sequences: list[tuple[list[int], list[int]]], max_draft: int, min_match: int = 2) -> float:
    """Decode forwards per output token if every step drafted the longest run (<= ``max_draft``) of the true
    answer that follows some earlier occurrence of the answer's last ``min_match`` tokens (the drafter's shortest
    n-gram) in the cached text: the (prompt, answer) pairs before it, its own prompt and its answer so far. A
    bound for any drafter that copies from context (a tree of every candidate, each verified for free)."""
    texts: list[list[int]] = []
    after: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (text, position after it)

    def index(text: int, start: int) -> None:
        seq = texts[text]
        for end in range(max(start, min_match), len(seq) + 1):
            after.setdefault(tuple(seq[end - min_match : end]), []).append((text, end))

    forwards = tokens = 0
    for prompt, answer in sequences:
        texts.append(list(prompt) + list(answer[:1]))  # the first token comes from the prefill
        index(len(texts) - 1, 0)
        done = 1
        while done < len(answer):
            want = answer[done : done + max_draft]
            key = tuple(texts[-1][-min_match:])
            run = max((_common(texts[t][end : end + len(want)], want) for t, end in after.get(key, [])), default=0)
            step = min(run + 1, len(answer) - done)  # the accepted drafts and the verify step's own token
            texts[-1].extend(answer[done : done + step])
            index(len(texts) - 1, len(texts[-1]) - step + 1)
            done += step
            forwards += 1
        tokens += len(answer) - 1
    return forwards / tokens if tokens else 1.0


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common start of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
        "tree": Drafter(num, both.index, use_prompt=False, costs=both.costs),
        "prompt": Drafter(num, None, use_prompt=True, costs=both.costs),
    }


def measure(
    engine: Engine, configs: dict[str, Drafter | None], run: Callable[[], Result]
) -> tuple[dict[str, tuple[float, float]], list[list[int]]]:
    """Each configuration once on a cold cache (order as given); (tok/s, forwards per token) by configuration,
    and the answers (greedy: they agree)."""
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
    return speeds, first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--quantization", default="auto", help="the engine's --quantization (q4_1: int8 activations)")
    parser.add_argument("--workloads", nargs="*", default=None, help="run only these (default: all)")
    parser.add_argument(
        "--row-cost", type=float, default=None, help="price verify rows at this many decode steps (default: measured)"
    )
    args = parser.parse_args(argv)
    engine = Engine(
        model_path=args.model_path,
        num_threads=args.threads,
        quantization=args.quantization,
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=args.num_draft_tokens,
        speculative_row_cost=args.row_cost,
    )
    costs = engine.describe()["speculative_verify_costs"]
    print(f"verify costs ({costs['source']}), decode steps by rows: {costs['steps_by_rows']}", flush=True)
    configs = drafters(engine, args.num_draft_tokens)
    table: dict[str, dict[str, list[tuple[float, float]]]] = {}
    bounds: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, prompts in workloads().items():
            if args.workloads is not None and name not in args.workloads:
                continue
            chosen = configs if name == "agent" else {k: configs[k] for k in ("off", "both")}
            order = dict(list(chosen.items())[round_ % len(chosen) :] + list(chosen.items())[: round_ % len(chosen)])
            schema = SCHEMAS.get(name)
            speeds, answers = measure(
                engine, order, partial(run_sequential, engine, prompts, args.max_new_tokens, schema)
            )
            ids = [engine.tokenizer.apply_chat_template(m) for m in prompts]
            bounds[name] = context_bound(list(zip(ids, answers)), args.num_draft_tokens)
            for config, speed in speeds.items():
                table.setdefault(name, {}).setdefault(config, []).append(speed)
        if args.workloads is None or "prose-x16" in args.workloads:
            batch = repeated(workloads()["prose"], 16)  # 16 requests at once
            both = {k: configs[k] for k in (("off", "both") if round_ % 2 == 0 else ("both", "off"))}
            speeds, _ = measure(engine, both, partial(run_batch, engine, batch, args.max_new_tokens // 2))
            for config, speed in speeds.items():
                table.setdefault("prose-x16", {}).setdefault(config, []).append(speed)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print_table(table, bounds)
    engine.close()


def print_table(table: dict[str, dict[str, list[tuple[float, float]]]], bounds: dict[str, float]) -> None:
    """Medians over rounds: tok/s, and (in brackets) decode forwards per output token; the bound on forwards
    per token for drafts from context (one request at a time only)."""
    print("| workload | off tok/s | both tok/s | both / off | tree tok/s | prompt tok/s | bound |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, by_config in table.items():
        speed = {config: statistics.median(v[0] for v in values) for config, values in by_config.items()}
        forwards = {config: statistics.median(v[1] for v in values) for config, values in by_config.items()}
        cells = {c: f"{speed[c]:.1f} ({forwards[c]:.2f})" for c in speed}
        ratio = speed["both"] / speed["off"]
        extra = " | ".join(cells.get(c, "") for c in ("tree", "prompt"))
        bound = f"{bounds[name]:.2f}" if name in bounds else ""
        print(f"| {name} | {cells['off']} | {cells['both']} | {ratio:.2f}x | {extra} | {bound} |")
