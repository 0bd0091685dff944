"""Does a cache hit change an answer? ``radixserve bench split-invariance``.

For random (prompt, split) pairs: the prompt is answered cold (empty cache), then the cache is flushed, its first
``split`` tokens are cached by a request of their own, and the whole prompt is asked again, now a cache hit whose
uncached tail is computed with another number of rows. Greedy tokens and the first token's top logprobs
(log-softmax of the last position's logits: equal logits give equal values) must equal the cold run's, bit for
bit. Prompts are slices of this repository's own documentation (real English text), tokenized by the model. Each
dtype runs with the engine's default (split-invariant) and, for comparison, ``--no-split-invariant``.
Prints per configuration the pairs, the token and logprob mismatches (target 0 for the default) and the time.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from radixserve import Engine

DOCS = Path(__file__).resolve().parent.parent / "docs"
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "top_logprobs": 5}


def corpus_words() -> list[str]:
    text = " ".join(path.read_text() for path in sorted(DOCS.rglob("*.md")))
    return re.sub(r"[`|#*\[\]()<>]", " ", text).split()


def mismatches(engine: Engine, pairs: int, prompt_tokens: int, seed: int) -> tuple[int, int, int]:
    """(pairs run, greedy token mismatches, first-token logprob mismatches) over ``pairs`` random pairs."""
    words, rng = corpus_words(), random.Random(seed)
    tokens = logprobs = done = 0
    while done < pairs:
        start = rng.randrange(0, len(words) - prompt_tokens)
        ids = engine.tokenizer.encode(" ".join(words[start : start + prompt_tokens]))[:prompt_tokens]
        engine.flush_cache()
        cold = engine.generate(input_ids=ids, sampling_params=GREEDY)
        for _ in range(min(4, pairs - done)):
            split = rng.randrange(1, len(ids))
            engine.flush_cache()
            engine.generate(input_ids=ids[:split], sampling_params={"max_new_tokens": 1, "temperature": 0.0})
            hot = engine.generate(input_ids=ids, sampling_params=GREEDY)
            tokens += hot.output_ids != cold.output_ids
            logprobs += hot.output_top_logprobs[:1] != cold.output_top_logprobs[:1]
            done += 1
    return done, tokens, logprobs


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench split-invariance", description=__doc__)
    parser.add_argument("--model-path", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--pairs", type=int, default=1000, help="(prompt, split) pairs per configuration")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--only-default", action="store_true", help="skip the --no-split-invariant comparison")
    parser.add_argument("--quantization", default="auto", help="e.g. q4_1: int8 activations")
    args = parser.parse_args(argv)
    print(f"{'dtype':9} {'split-invariant':>15} {'pairs':>6} {'token mism.':>11} {'logprob mism.':>13} {'s':>6}")
    for dtype in args.dtypes.split(","):
        for invariant in (True,) if args.only_default else (True, False):
            engine = Engine(
                model_path=args.model_path,
                dtype=dtype,
                num_threads=args.num_threads,
                max_total_tokens=4 * args.prompt_tokens + 64,
                split_invariant=invariant,
                quantization=args.quantization,
            )
            start = time.perf_counter()
            done, tokens, logprobs = mismatches(engine, args.pairs, args.prompt_tokens, args.seed)
            took = time.perf_counter() - start
            holds = f"{invariant} ({engine.split_invariant})"
            print(f"{dtype:9} {holds:>15} {done:>6} {tokens:>11} {logprobs:>13} {took:>6.0f}", flush=True)
            engine.close()
