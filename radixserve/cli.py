"""The ``radixserve`` command.

radixserve serve [flags]                      the HTTP server (OpenAI-compatible + native); --help lists flags
radixserve chat "question" ["question" ...]   offline chat on the embedded model (or --model-path)
radixserve demo                               the radix tree demo: inserts, splits, a match
radixserve bench NAME [...]                   benchmarks, from a source checkout (= python -m benchmarks NAME)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from radixserve.extras import missing_extra

if TYPE_CHECKING:
    from radixserve.server.args import ServerArgs

# The source checkout this package was imported from: the benchmarks' folder is beside it.
CHECKOUT = Path(__file__).resolve().parents[1]
NO_BENCHMARKS = (
    "radixserve bench runs the benchmarks of a source checkout; they are not part of the installed package.\n"
    "Clone the repository, install it with `pip install -e '.[bench]'` and run, from its root:\n"
    "    python -m benchmarks NAME [flags]    (or radixserve bench NAME [flags])"
)


def chat(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="radixserve chat", description="Ask the model, one question at a time.")
    parser.add_argument("questions", nargs="+", help="each is asked in a fresh conversation")
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prefix-cache", default="radix", choices=["radix", "block", "none"])
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads (1 is safe on a busy box)")
    args = parser.parse_args(argv)

    from radixserve import Engine

    engine = Engine.create(model_path=args.model_path, prefix_cache=args.prefix_cache, num_threads=args.num_threads)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    for question in args.questions:
        out = engine.chat([{"role": "user", "content": question}], params)
        print(f"\n> {question}\n{out.text}")
        print(
            f"  [{out.prompt_tokens} prompt tokens, {out.cached_tokens} from the cache, "
            f"{len(out.output_ids)} generated, {out.e2e_latency * 1000:.0f} ms]"
        )


def serve_replicas(server_args: ServerArgs) -> None:
    try:
        from radixserve.router.deployments import serve_replicas as serve_on_ray
    except ImportError as exc:
        if not (exc.name or "").startswith("ray"):
            raise
        raise missing_extra("router", "--replicas (Ray Serve)") from None
    serve_on_ray(server_args)


def bench(argv: list[str]) -> None:
    """``radixserve bench NAME [flags]``: ``python -m benchmarks`` of the checkout this package lives in."""
    if (CHECKOUT / "benchmarks" / "__init__.py").is_file() and str(CHECKOUT) not in sys.path:
        # An editable install maps the package alone onto the path (its console script does not see the cwd).
        sys.path.insert(0, str(CHECKOUT))
    try:
        benchmarks = importlib.import_module("benchmarks")
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        raise SystemExit(NO_BENCHMARKS) from None
    benchmarks.main(argv, prog="radixserve bench")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="radixserve", description="A RadixAttention LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="the HTTP server (pass --help after it for its flags)", add_help=False)
    commands.add_parser("chat", help="offline chat on the embedded model", add_help=False)
    commands.add_parser("demo", help="build the chapter's example tree and print it after every insert")
    # add_help=False: `radixserve bench NAME --help` is NAME's own help
    commands.add_parser("bench", help="benchmarks, from a source checkout (python -m benchmarks)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        from radixserve.server.args import parse_args

        server_args = parse_args(rest)
        if server_args.replicas:
            serve_replicas(server_args)
        else:
            from radixserve.server.launch import serve

            serve(server_args)
    elif args.command == "chat":
        chat(rest)
    elif args.command == "demo":
        from radixserve.cache.__main__ import main as demo

        demo()
    else:
        bench(rest)


if __name__ == "__main__":
    main()
