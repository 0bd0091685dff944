"""``radixserve bench scale-out``: one workload through ``radixserve serve --replicas N`` under each router.

Starts the Ray Serve deployment once per routing setup, one after another:

    cache-aware    --router cache-aware (precise index: the replicas' KV events)
    approximate    --router cache-aware --router-index approximate (the prompts it routed)
    round-robin    --router round-robin
    power-of-two   --router power-of-two

and replays the same few-shot workload (groups of prompts sharing a long
preamble, groups interleaved) against each, with each replica's KV pool
holding about half the groups' preambles: a router that keeps a group on one
replica lets the replicas split the preambles between them; one that spreads
every group over every replica makes each replica thrash through all of them.
Prints one table (hit rate from the responses' ``cached_tokens``, prompt
tokens computed over all replicas, req/s, TTFT) and writes a PNG and a JSON.
The real-scale comparison (8-128 replicas) is ``bench simulate --replicas``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.four_way import TINY_SIZES, WorkloadSizes, format_table, plot, run_one
from tests.support.tiny_model import build_engine_folder

RUNS: dict[str, tuple[str, ...]] = {
    "cache-aware": ("--router", "cache-aware"),
    "approximate": ("--router", "cache-aware", "--router-index", "approximate"),
    "round-robin": ("--router", "round-robin"),
    "power-of-two": ("--router", "power-of-two"),
}
SIZES = replace(TINY_SIZES, num_groups=8, prompts_per_group=6)
POOL = 4096  # tokens per replica: about half of the 8 x 1,024-token preambles


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="radixserve bench scale-out", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf (default: a random tiny Llama)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-groups", type=int, default=SIZES.num_groups)
    parser.add_argument("--prompts-per-group", type=int, default=SIZES.prompts_per_group)
    parser.add_argument("--max-total-tokens", type=int, default=POOL, help="KV pool of each replica")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {','.join(RUNS)}")
    args = parser.parse_args(argv)
    selected = [n.strip() for n in args.runs.split(",") if n.strip()]
    if not selected or any(n not in RUNS for n in selected):
        parser.error(f"--runs: choose from {', '.join(RUNS)}")
    sizes: WorkloadSizes = replace(SIZES, num_groups=args.num_groups, prompts_per_group=args.prompts_per_group)
    common = ("--replicas", str(args.replicas), "--max-total-tokens", str(args.max_total_tokens))

    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or str(build_engine_folder(Path(tmp) / "tiny-llama", max_position_embeddings=4096))
        for name in selected:
            flags = common + RUNS[name]
            print(f"[{name}] starting radixserve serve {' '.join(flags)}", flush=True)
            run = run_one(
                name, flags, model_path, functools.partial(sizes.trace, seed=args.seed), args.max_concurrency, math.inf
            )
            print(f"[{name}] up in {run.startup_s:.1f} s; benchmark {run.result.duration_s:.1f} s", flush=True)
            runs.append(run)
    wall = time.perf_counter() - started
    model_name = args.model_path or "tiny random Llama"
    workload = (
        f"{args.replicas} replicas x {args.max_total_tokens}-token pool; {sizes.describe()}; "
        f"concurrency {args.max_concurrency}"
    )
    print(f"\n{model_name}: {workload}; {len(runs)} runs in {wall:.0f} s (start-ups included)")
    print(format_table(runs))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    png, out_json = args.output_dir / "scale-out.png", args.output_dir / "scale-out.json"
    plot(runs, png, f"{model_name}: {workload}")
    report = {
        "model": model_name,
        "replicas": args.replicas,
        "workload": asdict(sizes),
        "max_total_tokens": args.max_total_tokens,
        "max_concurrency": args.max_concurrency,
        "wall_s": wall,
        "runs": {
            run.name: {"flags": list(run.flags), "startup_s": run.startup_s, **run.result.to_dict()} for run in runs
        },
    }
    out_json.write_text(json.dumps(report, indent=1))
    print(f"wrote {png} and {out_json}")
