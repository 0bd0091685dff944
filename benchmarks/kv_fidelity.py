"""The 8-bit KV pool against the 16-bit one on fixed prompts: ``radixserve bench kv-fidelity``.

On the embedded SmolLM2 (or ``--model-path``), two engines that differ only in ``--kv-cache-dtype``
(``--baseline``, bfloat16 by default, and ``--candidate``, int8 by default, or fp8_e4m3), the same weights, dtype
and ``--attention-backend``. Per prompt (a chat turn, a piece of code, a long document with a question: the Python
reference manual's "compound statements" topic, fixed text shipped with Python):

- top-1: the share of positions where both pools' next-token argmax agree, teacher-forced over every
  prompt token (the prompt prefilled in chunks of ``--chunk`` tokens, each an extend on the cached part:
  every position reads the pool, its own key and value included; the last ``--decode-tail`` positions one
  decode step each instead, read by the decode kernel as a generated token is);
- KL: the mean KL(baseline || candidate) of those next-token distributions, in nats;
- divergence: the first position where the two greedy continuations of ``--new-tokens`` tokens differ
  (``--new-tokens`` when they never do).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pydoc_data.topics import topics

import numpy as np

from radixserve.engine import Engine
from radixserve.model.forward import ForwardMode
from radixserve.model.runner import StepInput

CHAT = "What are three good habits for writing maintainable software? Answer briefly."
CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def test_merge_intervals():
    assert merge_intervals([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]


def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
'''
DOCUMENT_CHARS = 11_000  # about 2,400 SmolLM2 tokens


def prompts(engine: Engine, document_chars: int = DOCUMENT_CHARS) -> dict[str, list[int]]:
    """The fixed prompts as token ids: a chat turn through the model's template, code, a long document."""
    tokenizer = engine.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
    document = topics["compound"][:document_chars] + "\n\nQuestion: what does the else clause of a for loop do?\n"
    return {"chat": list(chat), "code": tokenizer.encode(CODE), "document": tokenizer.encode(document + "Answer:")}


@dataclass(frozen=True)
class Fidelity:
    num_tokens: int
    top1: float
    mean_kl: float
    divergence: int  # the first generated position that differs; new_tokens when none does


def forced_steps(num_tokens: int, chunk: int, decode_tail: int) -> list[tuple[int, int, ForwardMode]]:
    """(start, end, mode) of each teacher-forced forward: chunks, then the last ``decode_tail`` tokens one a step."""
    split = max(0, num_tokens - decode_tail)
    chunks: list[tuple[int, int, ForwardMode]] = [(a, min(split, a + chunk), "extend") for a in range(0, split, chunk)]
    return chunks + [(p, p + 1, "decode") for p in range(split, num_tokens)]


def teacher_forced(engines: list[Engine], ids: list[int], chunk: int, decode_tail: int = 0) -> tuple[float, float]:
    """(top-1 agreement, mean KL(first || second)) over every position of ``ids`` (``forced_steps``)."""
    runners = [e.executor.runner for e in engines]
    slots = []
    for engine in engines:
        taken = engine.allocator.alloc(len(ids))
        assert taken is not None, "pool too small"
        slots.append(taken)
    agree, kl_sum = 0, 0.0
    try:
        for start, end, mode in forced_steps(len(ids), chunk, decode_tail):
            logits = [
                r.forward([StepInput(ids[start:end], s[:end])], mode, all_logits=True) for r, s in zip(runners, slots)
            ]
            logp = [x.log_softmax(-1) for x in logits]
            agree += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
            kl_sum += float((logp[0].exp() * (logp[0] - logp[1])).sum())
    finally:
        for engine, s in zip(engines, slots):
            engine.allocator.free(s)
    return agree / len(ids), kl_sum / len(ids)


def first_divergence(engines: list[Engine], ids: list[int], new_tokens: int) -> int:
    greedy = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    outs = [e.generate(input_ids=ids, sampling_params=greedy).output_ids for e in engines]
    for e in engines:
        e.flush_cache()
    return next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), new_tokens)


def measure(engines: list[Engine], ids: list[int], chunk: int, new_tokens: int, decode_tail: int = 0) -> Fidelity:
    top1, kl = teacher_forced(engines, ids, chunk, decode_tail)
    return Fidelity(len(ids), top1, kl, first_divergence(engines, ids, new_tokens))


def build(model_path: str | None, kv_dtypes: list[str], pool_tokens: int, backend: str = "auto") -> list[Engine]:
    return [
        Engine.create(model_path=model_path, max_total_tokens=pool_tokens, kv_cache_dtype=kv, attention_backend=backend)
        for kv in kv_dtypes
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench kv-fidelity", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--baseline", default="bfloat16", help="the 16-bit (or float32) pool compared against")
    parser.add_argument(
        "--candidate", default="int8", help="the pool measured: int8, fp8_e4m3 (bfloat16 against a float32 baseline)"
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="both engines' (reference: gather + SDPA, as CUDA; what fp8_e4m3 needs on CPU)",
    )
    parser.add_argument("--document-chars", type=int, default=DOCUMENT_CHARS, help="of the long document")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--decode-tail", type=int, default=0, help="last positions forced as decode steps")
    args = parser.parse_args(argv)
    engines = build(args.model_path, [args.baseline, args.candidate], 8192, args.attention_backend)
    info = engines[1].describe()
    print(
        f"{info['resolved_dtype']} weights ({info['resolved_quantization']}), attention "
        f"{info['resolved_attention_backend']}; KV {args.baseline} vs {args.candidate}"
    )
    print(f"{'prompt':<10}{'tokens':>8}{'top-1':>8}{'mean KL':>11}{'first greedy divergence':>26}")
    rows = []
    for name, ids in prompts(engines[0], args.document_chars).items():
        row = measure(engines, ids, args.chunk, args.new_tokens, args.decode_tail)
        rows.append(row)
        div = f"{row.divergence}" if row.divergence < args.new_tokens else f"none in {args.new_tokens}"
        print(f"{name:<10}{row.num_tokens:>8}{row.top1:>8.3f}{row.mean_kl:>11.2e}{div:>26}")
    weights = np.array([r.num_tokens for r in rows], dtype=float)
    top1 = float(np.average([r.top1 for r in rows], weights=weights))
    kl = float(np.average([r.mean_kl for r in rows], weights=weights))
    print(f"{'all':<10}{int(weights.sum()):>8}{top1:>8.3f}{kl:>11.2e}")


if __name__ == "__main__":
    main()
