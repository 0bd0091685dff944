"""LlamaForCausalLM against HF transformers on tiny random models, and our own step invariants.

Every check drives the model through the KV pool the way the engine does:
slots from a TokenAllocator, one ForwardBatch per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from radixserve.model.gather import grouped_matmul_attention
from radixserve.model.llama import LlamaForCausalLM
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_untied": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_attention_bias": ("llama", {"attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama_rope_llama3": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500_000.0}),
    "llama_rope_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # max_position_embeddings 16: the 24-token prompt and the generation run past it.
    "llama_rope_dynamic": (
        "llama",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16},
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Case name -> (HF model, folder it was saved to); built once for the module."""
    built = {}
    for name, (arch, overrides) in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        built[name] = (build_hf_model(arch, folder, **overrides), folder)
    return built


def prompt(length: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (length,), generator=generator).tolist()


def prefill(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    pool, allocator = make_pool(model.config)
    return model(make_batch("extend", [(ids, alloc(allocator, len(ids)))]), pool, return_all_logits=True)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_hf(models: dict[str, tuple[Any, Path]], case: str) -> None:
    hf_model, folder = models[case]
    ids = prompt(24)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    ours = prefill(load_ours(folder), ids)
    assert ours.dtype == torch.float32 and ours.shape == (24, 128)
    assert (ours - expected).abs().max().item() <= 1e-3


def greedy(model: LlamaForCausalLM, ids: list[int], max_new_tokens: int) -> list[int]:
    """One extend step, then one decode step per token, slots allocated by hand."""
    pool, allocator = make_pool(model.config)
    context = alloc(allocator, len(ids))
    logits = model(make_batch("extend", [(ids, context)]), pool)
    out = [int(logits[0].argmax())]
    while len(out) < max_new_tokens:
        context = torch.cat([context, alloc(allocator, 1)])
        logits = model(make_batch("decode", [([out[-1]], context)]), pool)
        out.append(int(logits[0].argmax()))
    return out


@pytest.mark.parametrize("case", ["llama_untied", "qwen2", "llama_rope_dynamic"])
def test_greedy_generation_matches_hf(models: dict[str, tuple[Any, Path]], case: str) -> None:
    hf_model, folder = models[case]
    ids = prompt(10, seed=2)
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, 10, dtype=torch.int64),
            do_sample=False,
            max_new_tokens=20,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = generated[0, 10:].tolist()
    assert len(expected) == 20
    assert greedy(load_ours(folder), ids, 20) == expected


def test_mixed_length_extend_and_ragged_decode_match_single_requests(
    models: dict[str, tuple[Any, Path]],
) -> None:
    model = load_ours(models["qwen2"][1])
    prompts = [prompt(5, seed=3), prompt(13, seed=4), prompt(1, seed=5)]
    pool, allocator = make_pool(model.config)
    contexts = [alloc(allocator, len(p)) for p in prompts]
    batched = model(make_batch("extend", list(zip(prompts, contexts))), pool)
    next_ids = [[7], [8], [9]]
    contexts = [torch.cat([c, alloc(allocator, 1)]) for c in contexts]
    batched_decode = model(make_batch("decode", list(zip(next_ids, contexts))), pool)
    for i, ids in enumerate(prompts):
        alone_pool, alone_allocator = make_pool(model.config)
        context = alloc(alone_allocator, len(ids))
        alone = model(make_batch("extend", [(ids, context)]), alone_pool)
        assert (batched[i] - alone[0]).abs().max().item() <= 1e-4
        context = torch.cat([context, alloc(alone_allocator, 1)])
        alone = model(make_batch("decode", [(next_ids[i], context)]), alone_pool)
        assert (batched_decode[i] - alone[0]).abs().max().item() <= 1e-4


def test_extend_on_cached_prefix_matches_cold_prefill(models: dict[str, tuple[Any, Path]]) -> None:
    model = load_ours(models["llama_untied"][1])
    prefix, tail = prompt(9, seed=6), prompt(7, seed=7)
    pool, allocator = make_pool(model.config)
    alloc(allocator, 5)  # the cached run's slots are not the cold run's, nor contiguous with them
    prefix_slots = alloc(allocator, 9).flip(0)
    model(make_batch("extend", [(prefix, prefix_slots)]), pool)
    context = torch.cat([prefix_slots, alloc(allocator, 7)])
    cached = model(make_batch("extend", [(tail, context)]), pool, return_all_logits=True)
    cold = prefill(model, prefix + tail)
    assert (cached - cold[9:]).abs().max().item() <= 1e-4


def test_load_weights_rejects_missing_unknown_and_misshapen(models: dict[str, tuple[Any, Path]]) -> None:
    hf_model, folder = models["llama_untied"]
    model = load_ours(folder)
    good = {k: v.clone() for k, v in hf_model.state_dict().items()}
    good["model.rotary_emb.inv_freq"] = torch.ones(8)  # ignored: we compute our own
    model.load_weights(good)
    missing = {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"):
        model.load_weights(missing)
    with pytest.raises(ValueError, match=r"unknown tensors: \['model.layers.0.mlp.extra'\]"):
        model.load_weights({**good, "model.layers.0.mlp.extra": torch.zeros(1)})
    bad_shape = {**good, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"k_proj.weight: checkpoint shape \(64, 64\), model expects \(32, 64\)"):
        model.load_weights(bad_shape)


def test_bfloat16_extend_and_ragged_decode_stay_close_to_float32(models: dict[str, tuple[Any, Path]]) -> None:
    """bf16 weights and pool (decode takes the matmul path on CPU) against the float32 model."""
    folder = models["llama_untied"][1]
    prompts, next_ids = [prompt(6, seed=8), prompt(11, seed=9)], [[3], [4]]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = load_ours(folder, dtype)
        pool, allocator = make_pool(model.config, dtype=dtype)
        contexts = [alloc(allocator, len(p)) for p in prompts]
        extend = model(make_batch("extend", list(zip(prompts, contexts))), pool)
        contexts = [torch.cat([c, alloc(allocator, 1)]) for c in contexts]
        decode = model(make_batch("decode", list(zip(next_ids, contexts))), pool)
        results.append(torch.cat([extend, decode]))
    assert results[1].dtype == torch.float32
    assert (results[1] - results[0]).abs().max().item() <= 0.1


def test_grouped_matmul_decode_attention_matches_sdpa() -> None:
    """The bf16-on-CPU decode path, checked in float32 against SDPA with GQA and a ragged mask."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=generator)
    k, v = torch.randn(2, 3, 2, 10, 16, generator=generator)
    mask = (torch.arange(10)[None, :] < torch.tensor([10, 4, 7])[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]
    assert torch.allclose(grouped_matmul_attention(q, k, v, mask), expected, atol=1e-5)


def test_a_step_calls_only_the_model_through_module_call(models: dict[str, tuple[Any, Path]]) -> None:
    """The layers, norms, linears and embedding are run through their ``forward`` (nn.Module.__call__'s hook
    machinery was ~215 calls a decode step): a global forward hook sees the model's own call and nothing inside."""
    model = load_ours(models["llama_attention_bias"][1])
    pool, allocator = make_pool(model.config)
    ids = prompt(8)
    context = alloc(allocator, len(ids))
    called: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: called.append(type(module).__name__)
    )
    try:
        model(make_batch("extend", [(ids, context)]), pool)
        context = torch.cat((context, alloc(allocator, 1)))
        model(make_batch("decode", [([5], context)]), pool)
    finally:
        handle.remove()
    assert called == ["LlamaForCausalLM", "LlamaForCausalLM"]
