"""The fp8 KV pool (``--kv-cache-dtype fp8_e4m3``, vLLM's and SGLang's name): float8_e4m3fn codes with one bfloat16
scale per token and head (max|x| / 448), the int8 pool's layout and bytes. CUDA's attention gathers and widens any
pool, so it reads this one as it reads int8's; the CPU's kernels read int8 in place and not fp8, so on CPU the pool
needs the reference backend and the engine says so before it loads a weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.engine.config import EngineConfig
from radixserve.memory.kv_pool import KVPool
from radixserve.model.precision import resolve_kv_cache_dtype
from radixserve.server.args import parse_args
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

FP8 = torch.float8_e4m3fn


def test_the_pool_stores_fp8_codes_with_one_bfloat16_scale_per_token_and_head() -> None:
    pool = KVPool(2, 64, 3, 64, FP8)
    generator = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 5, 3, 64, generator=generator) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    k[0, 0, 5] = 0.0  # a zero and a value 2^-12 of its row's max (below fp8's normals once scaled)
    k[0, 0, 6] = k[0, 0].abs().max() / 4096
    slots = torch.tensor([3, 4, 9, 10, 11])
    pool.write(1, slots, k, v)
    assert pool.k[1].dtype == FP8 and pool.k_scale[1].shape == (3, 64) and pool.k_scale[1].dtype == torch.bfloat16
    for got, want, scale in zip(pool.dequantized(1, slots, torch.float32), (k, v), (pool.k_scale, pool.v_scale)):
        want = want.transpose(0, 1)
        step = scale[1][:, slots].float()[..., None] * 2.0**-10  # half the spacing of fp8's subnormals, scaled
        # 3 mantissa bits: within 1/16 of each value, or half a subnormal step of the row's scale below 2^-6
        assert ((got - want).abs() <= want.abs() / 16 + step).all()
        assert (got == 0).sum() >= (want == 0).sum()
    assert pool.k[1].float().abs().amax().item() == 448 and not pool.k[0].float().any()  # absmax at fp8's edge
    rows = pool.gather_rows(slots)
    assert rows.shape == (2, 2, 3, 5, 66) and rows.dtype == FP8  # 64 codes + the scale's 2 bytes
    copy = KVPool(2, 64, 3, 64, FP8)
    copy.scatter_rows(slots, rows)
    every = pool.k + pool.v + pool.k_scale + pool.v_scale
    copies = copy.k + copy.v + copy.k_scale + copy.v_scale
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(every, copies))  # bit for bit
    assert KVPool.bytes_per_token(30, 3, 64, FP8) == KVPool.bytes_per_token(30, 3, 64, torch.int8) == 30 * 3 * 2 * 66


def test_fp8_resolves_and_the_cpu_kernels_send_it_to_the_reference_backend(tiny_model_dir: Path) -> None:
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8
    for backend in ("auto", "paged"):  # a usage error of the flags, before any weight is read
        with pytest.raises(ValueError, match="fp8_e4m3.*--attention-backend reference.*use int8"):
            EngineConfig(kv_cache_dtype="fp8_e4m3", device="cpu", attention_backend=backend)
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"])
    flags = ["--kv-cache-dtype", "fp8_e4m3", "--device", "cpu", "--attention-backend", "reference"]
    assert parse_args(flags).engine.kv_cache_dtype == "fp8_e4m3"
    engine = Engine.create(
        model_path=str(tiny_model_dir), kv_cache_dtype="fp8_e4m3", attention_backend="reference", max_total_tokens=256
    )
    assert engine.describe()["resolved_kv_cache_dtype"] == "float8_e4m3fn"
    prompt = list(range(5, 45))
    cold = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0})
    hit = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert hit.cached_tokens > 0 and len(hit.output_ids) == len(cold.output_ids) == 8
    engine.check_idle_invariants()
    engine.close()


def test_the_reference_backend_reads_the_fp8_pool(tmp_path_factory: pytest.TempPathFactory) -> None:
    """float32 weights, one prefill and a decode step on each pool: the decode's logits against the float32 pool's.
    fp8 keeps 3 mantissa bits at every magnitude where int8 spaces 255 levels evenly: on this random model's K/V
    (Gaussian rows, no outliers) int8 is off by 6.7e-3 of the largest logit and fp8 by 4.6e-2 (measured)."""
    folder = tmp_path_factory.mktemp("ref-fp8")
    build_hf_model("llama", folder)
    model = load_ours(folder, torch.float32, "reference")
    logits = {}
    for dtype in (torch.float32, torch.int8, FP8):
        pool, allocator = make_pool(model.config, dtype=dtype)
        prompt = list(range(3, 40))
        context = alloc(allocator, len(prompt))
        model(make_batch("extend", [(prompt, context)]), pool)
        logits[dtype] = model(make_batch("decode", [([7], torch.cat([context, alloc(allocator, 1)]))]), pool)
    top = logits[torch.float32].abs().max().item()
    errors = {dtype: (logits[dtype] - logits[torch.float32]).abs().max().item() / top for dtype in (torch.int8, FP8)}
    assert 0 < errors[torch.int8] < 1.5e-2 and 0 < errors[FP8] < 0.1, errors
    assert np.isfinite(logits[FP8].numpy()).all()
