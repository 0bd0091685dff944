"""``radixserve bench four-way``: the chapter's experiment, four server configurations on one workload.

Starts ``radixserve serve --enable-metrics`` four times, one after another:

    baseline   fcfs, page size 1, lru eviction (the defaults)
    lpm+slru   --schedule-policy lpm --radix-eviction-policy slru
    page16     --page-size 16
    no-cache   --disable-radix-cache (the control)

and drives each with the same few-shot workload (``generated_shared_prefix``):
groups of prompts share a long preamble (system prompt + few-shot examples),
each prompt ends in its own question, and the groups are interleaved and sent
all at once, so the waiting queue holds every group and LPM has something to
reorder. The KV pool holds about half the groups' preambles: which requests run
first decides what stays cached (with room for everything, in-batch dedup
computes each preamble once under any policy). Prints one side-by-side table
(hit rate, prompt tokens computed, req/s, output tok/s, TTFT p50 / p90) and
writes a PNG (one panel per figure) and a JSON with every run's full results
into ``--output-dir``.

Default sizes fit SmolLM2 on a 2-core CPU in about 7 minutes including the four
start-ups; ``--tiny`` runs a random tiny Llama with larger sizes in well under 2 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from benchmarks.serve import BenchResult, run_benchmark, server_vocab_size
from benchmarks.workloads import TraceRequest, generated_shared_prefix
from radixserve.extras import missing_extra
from tests.support.server_process import ServerProcess
from tests.support.tiny_model import build_engine_folder

RUNS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "lpm+slru": ("--schedule-policy", "lpm", "--radix-eviction-policy", "slru"),
    "page16": ("--page-size", "16"),
    "no-cache": ("--disable-radix-cache",),
}


@dataclass(frozen=True)
class WorkloadSizes:
    num_groups: int
    prompts_per_group: int
    system_prompt_len: int  # the preamble a group shares (system prompt + few-shot examples)
    question_len: int
    output_len: int
    grouped: bool = False  # each group's requests queued together instead of interleaved with the others

    def describe(self) -> str:
        order = "grouped" if self.grouped else "interleaved"
        return (
            f"{self.num_groups} groups x {self.prompts_per_group} prompts ({order}), {self.system_prompt_len}-token "
            f"preamble + {self.question_len}-token question, {self.output_len} output tokens"
        )

    def trace(self, vocab_size: int, seed: int = 0) -> list[TraceRequest]:
        return generated_shared_prefix(**asdict(self), seed=seed, vocab_size=vocab_size)


SMOLLM2_SIZES = WorkloadSizes(4, 6, 1000, 48, 16)
TINY_SIZES = WorkloadSizes(8, 8, 1024, 64, 32)
# KV pool per server, in tokens: about half the groups' preambles fit (see the docstring).
SMOLLM2_POOL, TINY_POOL = 2560, 4096


@dataclass(frozen=True)
class RunResult:
    name: str
    flags: tuple[str, ...]
    startup_s: float
    result: BenchResult


def run_one(
    name: str,
    flags: tuple[str, ...],
    model_path: str | None,
    trace_for: Callable[[int], list[TraceRequest]],
    max_concurrency: int | None,
    request_rate: float,
) -> RunResult:
    """Start a server with ``flags``, replay ``trace_for(vocab_size)`` against it, stop it."""
    t0 = time.perf_counter()
    server = ServerProcess("--enable-metrics", "--log-level", "warning", *flags, model_path=model_path)
    server.start(timeout=600)
    startup = time.perf_counter() - t0
    try:
        vocab = server_vocab_size(server.url, None)
        if vocab is None:
            raise RuntimeError(f"no vocabulary size from {server.url}/server_info")
        result = asyncio.run(
            run_benchmark(
                server.url, trace_for(vocab), max_concurrency=max_concurrency, request_rate=request_rate, progress=True
            )
        )
    finally:
        server.stop()
    return RunResult(name, flags, startup, result)


def format_table(runs: list[RunResult]) -> str:
    header = (
        f"{'run':<10} {'hit rate':>9} {'prefill tokens':>15} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'failed':>7}"
    )
    lines = [header, "-" * len(header)]
    for run in runs:
        r = run.result
        prefill = "n/a" if r.prefill_tokens is None else f"{r.prefill_tokens:,}"
        lines.append(
            f"{run.name:<10} {r.cache_hit_rate:>9.1%} {prefill:>15} {r.request_throughput:>7.2f} "
            f"{r.output_throughput:>10.1f} {r.ttft.p50_ms:>12.0f} {r.ttft.p90_ms:>12.0f} "
            f"{r.failed:>7}"
        )
    return "\n".join(lines)


def plot(runs: list[RunResult], path: Path, title: str) -> None:
    """One bar panel per figure, the runs side by side (Agg: no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise missing_extra("bench", "a plot") from None

    panels: list[tuple[str, Callable[[BenchResult], float]]] = [
        ("cache hit rate (%)", lambda r: 100 * r.cache_hit_rate),
        ("prompt tokens computed", lambda r: float(r.prefill_tokens or 0)),
        ("throughput (req/s)", lambda r: r.request_throughput),
        ("output throughput (tok/s)", lambda r: r.output_throughput),
        ("TTFT p50 (ms)", lambda r: r.ttft.p50_ms),
        ("TTFT p90 (ms)", lambda r: r.ttft.p90_ms),
    ]
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    names = [run.name for run in runs]
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8c8c8c", "#8172b2"][: len(runs)]
    for ax, (label, value) in zip(fig.subplots(2, 3).flat, panels):
        heights = [value(run.result) for run in runs]
        bars = ax.bar(names, [0.0 if math.isnan(h) else h for h in heights], color=colors)
        ax.bar_label(bars, labels=[f"{h:,.0f}" if h >= 100 else f"{h:.3g}" for h in heights], fontsize=8)
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def run_four_way(
    model_path: str | None,
    names: list[str],
    sizes: WorkloadSizes,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    max_total_tokens: int | None = None,
    seed: int = 0,
) -> list[RunResult]:
    extra = ("--max-total-tokens", str(max_total_tokens)) if max_total_tokens else ()
    runs = []
    for name in names:
        print(f"[{name}] starting radixserve serve {' '.join(RUNS[name] + extra)}", flush=True)
        run = run_one(
            name,
            RUNS[name] + extra,
            model_path,
            functools.partial(sizes.trace, seed=seed),
            max_concurrency,
            request_rate,
        )
        print(f"[{name}] server up in {run.startup_s:.1f} s; benchmark {run.result.duration_s:.1f} s", flush=True)
        runs.append(run)
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve bench four-way", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama (4k context) and sizes for it")
    names = [f.name for f in fields(WorkloadSizes) if f.type == "int"]
    for name in names:
        smol, tiny = getattr(SMOLLM2_SIZES, name), getattr(TINY_SIZES, name)
        parser.add_argument(
            "--" + name.replace("_", "-"), type=int, default=None, help=f"default {smol} ({tiny} with --tiny)"
        )
    parser.add_argument(
        "--grouped",
        action="store_true",
        help="send each group's requests together (default: groups interleaved, LPM's best case)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="default: no cap")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals (default: all at once)")
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help=f"KV pool of every server (default {SMOLLM2_POOL}, {TINY_POOL} with --tiny; 0: the "
        "server's own default, room for everything)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {','.join(RUNS)}")
    return parser


def main(argv: list[str]) -> None:
    parser = build_parser()
    names = [f.name for f in fields(WorkloadSizes) if f.type == "int"]
    args = parser.parse_args(argv)
    selected = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in selected if n not in RUNS]
    if unknown or not selected:
        parser.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    sizes = replace(
        TINY_SIZES if args.tiny else SMOLLM2_SIZES,
        **{n: getattr(args, n) for n in names if getattr(args, n) is not None},
        grouped=args.grouped,
    )

    pool = args.max_total_tokens if args.max_total_tokens is not None else (TINY_POOL if args.tiny else SMOLLM2_POOL)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path
        if args.tiny and model_path is None:
            model_path = str(build_engine_folder(Path(tmp) / "tiny-llama", max_position_embeddings=4096))
        runs = run_four_way(
            model_path,
            selected,
            sizes,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            max_total_tokens=pool or None,
            seed=args.seed,
        )
    wall = time.perf_counter() - started
    model_name = "tiny random Llama" if args.tiny and args.model_path is None else (args.model_path or "SmolLM2-135M")
    workload = f"{sizes.describe()}; KV pool {pool or 'server default'}"
    print(f"\n{model_name}: {workload}; {len(runs)} runs in {wall:.0f} s (start-ups included)")
    print(format_table(runs))
    write_report(args, runs, sizes, pool, model_name, wall)


def write_report(
    args: argparse.Namespace, runs: list[RunResult], sizes: WorkloadSizes, pool: int, model_name: str, wall: float
) -> None:
    """The plot and the JSON report in ``--output-dir``."""
    workload = f"{sizes.describe()}; KV pool {pool or 'server default'}"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    png, out_json = args.output_dir / "four-way.png", args.output_dir / "four-way.json"
    plot(runs, png, f"{model_name}: {workload}")
    report = {
        "model": model_name,
        "workload": asdict(sizes),
        "max_concurrency": args.max_concurrency,
        "request_rate": str(args.request_rate),
        "max_total_tokens": pool or None,
        "wall_s": wall,
        "runs": {
            run.name: {"flags": list(run.flags), "startup_s": run.startup_s, **run.result.to_dict()} for run in runs
        },
    }
    out_json.write_text(json.dumps(report, indent=1))
    print(f"wrote {png} and {out_json}")
