"""Model speed next to HF transformers: ``python -m radixserve.bench.model_speed``.

On the embedded SmolLM2-135M (or ``--model-path``), same weights, same process,
same thread count, float32: prefill tokens/s at 512 and 2,048-token prompts,
decode tokens/s at batch 1, 8, 32, and the TTFT of a 2,135-token request whose
first 2,055 tokens are cached vs cold. Token ids are seeded random draws.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixserve.engine import Engine
from radixserve.model.config import ModelConfig
from radixserve.model.loader import read_checkpoint
from radixserve.scheduler.request import Request, Status


def hf_reference(engine: Engine) -> Any:
    """A transformers LlamaForCausalLM holding exactly the engine's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c: ModelConfig = engine.loaded.config
    options: dict[str, Any] = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = LlamaForCausalLM(LlamaConfig(**options))
    model.eval()  # type: ignore[no-untyped-call]
    _, _, weights = read_checkpoint(engine.loaded.path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best of ``repeat`` wall-clock seconds (the machine is shared: best is the least noisy)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def ttft(engine: Engine, ids: np.ndarray, cold: bool) -> float:
    """Best wall-clock seconds to the first token of ``ids`` (cold: after emptying the cache)."""

    def run() -> None:
        if cold:
            engine.flush_cache()
        engine.generate(input_ids=ids.tolist(), sampling_params={"max_new_tokens": 1})

    return timed(run)


@torch.inference_mode()
def hf_prefill(model: Any, ids: np.ndarray) -> float:
    x = torch.from_numpy(ids)[None]
    return timed(lambda: model(x, use_cache=True))


def ours_decode(engine: Engine, batch: int, prompt_len: int, steps: int, rng: np.random.Generator) -> float:
    """Seconds per decode step for ``batch`` running requests (prefill excluded)."""
    engine.flush_cache()
    sched, vocab = engine.scheduler, engine.loaded.config.vocab_size
    for _ in range(batch):
        ids = rng.integers(0, vocab, prompt_len)
        sched.add(Request(10**9 + int(rng.integers(10**9)), ids, _params(steps + 2)))
    while sched.waiting:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    while sched.has_work():
        engine.step()
    assert all(r.status is not Status.RUNNING for r in sched.running)
    return elapsed / steps


@torch.inference_mode()
def hf_decode(model: Any, batch: int, prompt_len: int, steps: int, rng: np.random.Generator) -> float:
    ids = torch.from_numpy(rng.integers(0, model.config.vocab_size, (batch, prompt_len)))
    out = model(ids, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)  # transformers 5: `cache`, not past_key_values
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps


def row(name: str, ours: float, reference: float | None) -> None:
    ref = "-" if reference is None else f"{reference:.1f}"
    print(f"{name:<34} {ours:>12.1f} {ref:>14}")


def _params(n: int) -> Any:
    from radixserve.core import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve bench model-speed", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    engine = Engine.create(model_path=args.model_path, num_threads=args.num_threads, max_total_tokens=40_000)
    vocab = engine.loaded.config.vocab_size
    hf = None if args.no_hf else hf_reference(engine)
    print(f"{'fp32, ' + str(args.num_threads) + ' thread(s)':<34} {'radixserve':>12} {'transformers':>14}")
    for n in (512, 2048):
        ids = rng.integers(0, vocab, n)
        row(
            f"prefill tok/s, {n}-token prompt",
            n / ttft(engine, ids, cold=True),
            n / hf_prefill(hf, ids) if hf else None,
        )
    for b in (int(x) for x in args.batches.split(",")):
        ours = b / ours_decode(engine, b, 128, args.decode_steps, rng)
        row(f"decode tok/s, batch {b}", ours, b / hf_decode(hf, b, 128, args.decode_steps, rng) if hf else None)
    shared = rng.integers(0, vocab, 2055)
    cold = ttft(engine, np.concatenate([shared, rng.integers(0, vocab, 80)]), cold=True)
    engine.generate(input_ids=shared.tolist(), sampling_params={"max_new_tokens": 1})
    warm = ttft(engine, np.concatenate([shared, rng.integers(0, vocab, 80)]), cold=False)
    print(
        f"TTFT 2,135 tokens: cold {cold * 1000:.0f} ms, 2,055 cached {warm * 1000:.0f} ms ({cold / warm:.1f}x faster)"
    )


if __name__ == "__main__":
    main()
