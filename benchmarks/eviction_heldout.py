"""``radixserve bench policy-table``: the online eviction policies on data they were not tuned on.

Two tables (issue 36):

1. Held-out production traces: the second half (by time) of each Mooncake trace (``--trace mooncake:PATH``
   replay: 32-token blocks, page 1, concurrency 16, the trace's timestamps as the clock) at each capacity
   (a share of that half's working set): every policy's hit rate and Belady's bound; for each online policy
   (adaptive, learned, minisim) the points over the best fixed one, the share of the LRU-to-Belady gap it closes, and
   its cache CPU per request over LRU's in the same replay (µs/request, thread CPU time, least of --repeat).
2. Randomised families (families.py): per family and capacity, each online policy's worst seed against the
   best fixed policy of that seed (and which seed), over the held-out seeds, and the mean.

The policies' constants were tuned on the first halves and on ``families.TUNING_SEEDS`` only. ``--policies`` also
takes the oracles ``oracle-ever`` and ``oracle-ever-leaf`` (``belady.py``: they know whether a leaf is read again,
not when), reported as the online policies are.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from benchmarks.belady import ORACLES
from benchmarks.families import FAMILIES, HELD_OUT_SEEDS, TUNING_SEEDS, draw
from benchmarks.policy_table import ONLINE
from benchmarks.simulate import SimResult, read_trace, replay, simulate
from benchmarks.traces import working_set_tokens
from benchmarks.workloads import TraceRequest
from radixserve.cache.core.policy import EvictionStrategy
from radixserve.cache.core.radix import RadixCache
from radixserve.memory import TokenAllocator

FIXED = ("lru", "lfu", "slru")


def run(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    fractions: Sequence[float],
    bound: bool,
    repeat: int,
    extra: Mapping[str, Callable[[], EvictionStrategy]] | None = None,
) -> dict[float, dict[str, SimResult]]:
    """Every policy (and Belady) at every capacity, on the trace clock: {fraction: {policy: result}}.

    ``extra``: strategies outside the registry (name -> a fresh one per replay), replayed the same way."""
    working_set = working_set_tokens(requests)
    caches = [p if p in ORACLES else f"radix-{p}-p1" for p in policies] + (["belady"] if bound else [])
    capacities = [max(int(f * working_set), 16) for f in fractions]
    results = simulate(requests, caches, capacities, repeat=repeat, trace_clock=True)
    for name, make in (extra or {}).items():
        for capacity in capacities:

            def factory(
                clock: list[float], make: Callable[[], EvictionStrategy] = make, size: int = capacity
            ) -> RadixCache:
                return RadixCache(TokenAllocator(size), 1, make(), clock=lambda: float(clock[1]))

            runs = [
                replay(requests, name, capacity, working_set=working_set, trace_clock=True, factory=factory)
                for _ in range(max(repeat, 1))
            ]
            results.append(min(runs, key=lambda r: r.cache_seconds))
    table: dict[float, dict[str, SimResult]] = {f: {} for f in fractions}
    for r in results:
        fraction = fractions[capacities.index(r.capacity)]
        table[fraction][r.cache.removeprefix("radix-").removesuffix("-p1")] = r
    return table


def trace_table(
    label: str, table: dict[float, dict[str, SimResult]], policies: Sequence[str], online: Sequence[str] = ONLINE
) -> list[str]:
    """One line per capacity: every policy's hit rate, then each ``online`` one against the best fixed policy."""
    lines = []
    for fraction, rows in table.items():
        fixed = max((rows[p] for p in FIXED if p in rows), key=lambda r: r.hit_rate)
        lru, bound = rows.get("lru"), rows.get("belady")
        cells = " ".join(f"{rows[p].hit_rate:>8.2%}" for p in [*policies, "belady"] if p in rows)
        notes = []
        for p in (p for p in online if p in rows):
            r = rows[p]
            closed = ""
            if lru is not None and bound is not None and bound.hit_rate > lru.hit_rate:
                closed = f" closes {(r.hit_rate - lru.hit_rate) / (bound.hit_rate - lru.hit_rate):.0%}"
            cpu = f" {r.us_per_request:.0f}/{lru.us_per_request:.0f} µs" if lru is not None else ""
            best = fixed.cache.removeprefix("radix-").removesuffix("-p1")
            notes.append(f"{p} {(r.hit_rate - fixed.hit_rate) * 100:+.2f} pt vs {best}{closed}{cpu}")
        lines.append(f"{label:<22} {fraction:>5.0%} {cells}   {'; '.join(notes)}")
    return lines


def rivals(policies: Sequence[str]) -> list[str]:
    """The policies each table sets against the best fixed one: every one asked that is not fixed (the online
    policies, and the oracles)."""
    return [p for p in policies if p not in FIXED]


def family_table(
    families: Sequence[str],
    seeds: Sequence[int],
    fractions: Sequence[float],
    policies: Sequence[str],
    extra: Mapping[str, Callable[[], EvictionStrategy]] | None = None,
) -> list[str]:
    lines = []
    online = [*rivals(policies), *(extra or {})]
    for family in families:
        margins: dict[tuple[float, str], list[tuple[float, int]]] = {}
        for seed in seeds:
            _, requests = draw(family, seed)
            for fraction, rows in run(requests, policies, fractions, False, 1, extra).items():
                best = max(rows[p].hit_rate for p in FIXED if p in rows)
                for p in online:
                    margins.setdefault((fraction, p), []).append(((rows[p].hit_rate - best) * 100, seed))
        for fraction in fractions:
            cells = []
            for p in online:
                values = margins[(fraction, p)]
                worst, seed = min(values)
                mean = sum(v for v, _ in values) / len(values)
                cells.append(f"{p} worst {worst:+6.2f} pt (seed {seed}) mean {mean:+5.2f}")
            lines.append(f"{family:<14} {fraction:>5.0%}  " + "   ".join(cells))
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve bench policy-table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policies", default=",".join([*FIXED, *ONLINE]), help="registered policies, and oracle-ever (belady.py)"
    )
    return add_replay_arguments(parser)


def add_replay_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The traces, capacities, families and seeds a held-out replay runs on (``policy-table``, ``insertion``)."""
    parser.add_argument("--traces", default="", help="comma-separated mooncake:PATH (or PATH) traces")
    parser.add_argument("--time-slice", default="second-half", choices=("all", "first-half", "second-half"))
    parser.add_argument("--block-tokens", type=int, default=32, help="mooncake:PATH: tokens a 512-token block becomes")
    parser.add_argument("--fractions", default="0.05,0.1,0.25", help="trace capacities: shares of the working set")
    parser.add_argument("--repeat", type=int, default=1, help="replays per trace cache; the least CPU time is kept")
    parser.add_argument("--families", default=",".join(FAMILIES), help="randomised families ('' for none)")
    parser.add_argument("--seeds", default="held-out", help="held-out, tuning, or comma-separated seeds")
    parser.add_argument("--family-fractions", default="0.1,0.25")
    return parser


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    start = time.perf_counter()
    if args.traces:
        fractions = [float(f) for f in args.fractions.split(",")]
        print(f"traces, {args.time_slice} (the policies were tuned on first halves only): hit rate of prompt tokens")
        print(f"{'trace':<22} {'cap':>5} " + " ".join(f"{p:>8}" for p in [*policies, "belady"]))
        for spec in (s for s in args.traces.split(",") if s):
            requests = read_trace(spec, 512, args.block_tokens, None, args.time_slice)
            table = run(requests, policies, fractions, True, args.repeat)
            label = Path(spec.removeprefix("mooncake:")).stem
            print("\n".join(trace_table(label, table, policies, rivals(policies))), flush=True)
    print_families(args, policies)
    print(f"\n{time.perf_counter() - start:.0f} s")


def print_families(
    args: argparse.Namespace,
    policies: Sequence[str],
    extra: Mapping[str, Callable[[], EvictionStrategy]] | None = None,
) -> None:
    """The randomised families' table for ``add_replay_arguments``' flags (none when --families is empty)."""
    families = [f for f in args.families.split(",") if f]
    if not families:
        return
    named = {"held-out": HELD_OUT_SEEDS, "tuning": TUNING_SEEDS}
    seeds = named.get(args.seeds) or tuple(int(s) for s in args.seeds.split(","))
    fractions = [float(f) for f in args.family_fractions.split(",")]
    print(f"\nrandomised families, {len(seeds)} seeds each: points against the best fixed policy of each seed")
    print("\n".join(family_table(families, seeds, fractions, policies, extra)), flush=True)
