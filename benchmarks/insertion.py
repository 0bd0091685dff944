"""``radixserve bench insertion``: thrash-resistant insertion on production traces, and the premise it rests on.

Issue 36's hypothesis: at 5-10% capacity most reuse distances exceed the pool, so LRU thrashes, and a policy that
keeps a *stable subset* gets hits in proportion to capacity over reuse distance without predicting anything (the
case for LIP / BIP / DIP, Qureshi et al., ISCA '07, and RRIP, Jaleel et al., ISCA '10). Per trace:

1. the premise, without a tree (``stack_curve.py``): LRU's hit-rate curve over the block stream and the best
   stable subset's s x LRU(C / s); thrashing would show as a subset beating LRU;
2. the insertion policies of ``insertion_policies.py`` beside the registered ones and Belady, replayed as
   ``bench policy-table`` does (page 1, concurrency 16, the trace clock, capacity a share of the slice's working
   set): hit rate, points against the best fixed policy, the share of the LRU-to-Belady gap closed, µs of cache
   CPU per request against LRU's in the same replay (least of ``--repeat``);

then the randomised families (``families.py``), each insertion policy's worst seed against that seed's best fixed
policy. Tune on ``--time-slice first-half --seeds tuning``, report on the defaults (second halves, held-out seeds).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.eviction_heldout import add_replay_arguments, print_families, run, trace_table
from benchmarks.insertion_policies import INSERTION
from benchmarks.simulate import read_trace
from benchmarks.stack_curve import stack_curve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve bench insertion", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--curve-fractions", default="0.025,0.05,0.075,0.1,0.15,0.25,0.5")
    parser.add_argument("--policies", default="lru,lfu,slru,adaptive,when", help="registered policies beside")
    parser.add_argument("--insertion", default=",".join(INSERTION), help="insertion policies (insertion_policies)")
    return add_replay_arguments(parser)


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    policies = [p for p in args.policies.split(",") if p]
    extra = {name: INSERTION[name] for name in args.insertion.split(",") if name}
    for spec in (s for s in args.traces.split(",") if s):
        requests = read_trace(spec, 512, args.block_tokens, None, args.time_slice)
        label = Path(spec.removeprefix("mooncake:")).stem
        print(f"\n{label}, {args.time_slice}: the premise (block stream, no tree): LRU against a stable subset")
        print("\n".join(stack_curve(requests, [float(f) for f in args.curve_fractions.split(",")], args.block_tokens)))
        print(f"\n{label}: hit rate of prompt tokens")
        print(f"{'trace':<22} {'cap':>5} " + " ".join(f"{p:>8}" for p in [*policies, *extra, "belady"]))
        table = run(requests, policies, [float(f) for f in args.fractions.split(",")], True, args.repeat, extra)
        print("\n".join(trace_table(label, table, [*policies, *extra], list(extra))), flush=True)
    print_families(args, policies, extra)
    print(f"\n{time.perf_counter() - start:.0f} s")
