"""The ``radixserve`` command: ``radixserve demo``, ``radixserve bench cache-ops``.

(The server, ``radixserve serve``, arrives with the engine.)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="radixserve", description="A RadixAttention LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="build the chapter's example tree and print it after every insert")
    bench = commands.add_parser("bench", help="benchmarks (each prints its figures)")
    bench.add_argument("name", choices=["cache-ops"], help="which benchmark; pass --help after it for its flags")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from radixserve.cache.__main__ import main as demo

        demo()
    elif args.name == "cache-ops":
        from radixserve.bench.cache_ops import main as cache_ops

        cache_ops(rest)


if __name__ == "__main__":
    main()
