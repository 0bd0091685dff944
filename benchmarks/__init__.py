"""The benchmarks, beside the package: ``pip install radixserve`` ships the engine and the server only.

From a source checkout: ``python -m benchmarks NAME [flags]``, or ``radixserve bench NAME [flags]``
(the same command through the package's entry point). ``NAME --help`` lists a benchmark's flags;
each prints its figures, and the plots and tables go under docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import importlib

# NAME -> the module of this package whose main(argv) runs it
BENCHMARKS = {
    "cache-ops": "cache_ops",
    "model-speed": "model_speed",
    "block-linears": "block_linears",
    "schedule": "schedule",
    "responsiveness": "responsiveness",
    "simulate": "simulate",
    "policy-table": "eviction_heldout",
    "when-signal": "when_signal",
    "insertion": "insertion",
    "serve": "serve",
    "four-way": "four_way",
    "soak": "soak",
    "scale-out": "scale_out",
    "mixed-chunk": "mixed_chunk",
    "tiers": "tiers",
    "warm-scan": "warm_scan",
    "programs": "programs",
    "split-invariance": "split_invariance",
    "quant-formats": "quant_formats",
    "kv-fidelity": "kv_fidelity",
    "kv-attention": "kv_attention",
    "speculative": "speculative",
    "peer-serve": "peer_serve",
}


def main(argv: list[str], prog: str = "python -m benchmarks") -> None:
    """Run the benchmark named by ``argv[0]`` with the rest as its flags; without a name, list them."""
    parser = argparse.ArgumentParser(prog=prog, description="Run one benchmark (each prints its figures).")
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="pass --help after it for its flags")
    if not argv or argv[0].startswith("-"):
        parser.print_help()
        return
    name = parser.parse_args(argv[:1]).name
    # Imported on demand: a benchmark's module may need an extra (sglang, matplotlib) the others do not.
    importlib.import_module(f"{__name__}.{BENCHMARKS[name]}").main(argv[1:])
