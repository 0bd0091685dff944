"""Every architecture against transformers (tiny random models of tests/support/archs.py, float32): logits
within 1e-3 on prompts longer than the sliding window, greedy tokens equal, on the reference and the default
attention backends; an extend on a cached prefix equals a cold prefill; mixed batches equal single runs.
The cases are archs.py's fixtures with the settings their GGUFs cannot carry (a query scale other than
head_dim, per-layer types, qwen2's window layers) or that they leave out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.model.hf_loader import load_hf_folder
from tests.model.test_llama import greedy, prefill
from tests.model.tiny import alloc, load_ours, make_batch, make_pool
from tests.support.archs import WINDOW
from tests.support.fidelity import fixture_prompt, reference_greedy, reference_logits

GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
# case -> (archs.py fixture, overrides); gemma's query_pre_attn_scalar 24 is not head_dim (16), so a scale
# taken from head_dim shows
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"tie_word_embeddings": False}),
    "qwen3_tied": ("qwen3", {}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "mistral_window": ("mistral", {}),
    "phi3": ("phi3", {"sliding_window": None}),
    "phi3_window": ("phi3", {}),
    "gemma2": ("gemma2", {"num_hidden_layers": 3, "query_pre_attn_scalar": 24, "tie_word_embeddings": True}),
    "gemma3": (
        "gemma3",
        {
            "num_hidden_layers": 4,
            "layer_types": GEMMA3_LAYERS,
            "rope_parameters": GEMMA3_ROPE,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_final_softcap": ("gemma3", {"num_hidden_layers": 2, "final_logit_softcapping": 5.0}),
}
BACKENDS = ("reference", "auto")


@pytest.fixture(scope="module")
def folders(arch_folder: Callable[..., Path]) -> dict[str, Path]:
    return {case: arch_folder(name, **overrides) for case, (name, overrides) in CASES.items()}


def test_configs_carry_each_architectures_differences(folders: dict[str, Path]) -> None:
    qwen3 = load_hf_folder(folders["qwen3"])[0]
    assert qwen3.architecture == "qwen3" and qwen3.qk_norm and not qwen3.attention_bias and qwen3.sliding_window is None
    gemma2 = load_hf_folder(folders["gemma2"])[0]
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.attn_logit_softcapping == 2.0 and gemma2.final_logit_softcapping == 3.0
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.sandwich_norms and gemma2.norm_unit_offset
    assert [gemma2.layer_window(i) for i in range(3)] == [WINDOW, 0, WINDOW]
    assert gemma2.attention_scale() == 24**-0.5
    gemma3 = load_hf_folder(folders["gemma3"])[0]
    assert gemma3.qk_norm and gemma3.rope_local_base_freq == 10_000.0 and gemma3.rope_theta == 1_000_000.0
    assert gemma3.rope_type == "linear" and gemma3.layer_types == tuple(GEMMA3_LAYERS)
    assert load_hf_folder(folders["mistral_window"])[0].layer_types == ("sliding_attention",) * 2
    qwen2 = load_hf_folder(folders["qwen2_window"])[0]
    assert [qwen2.layer_window(i) for i in range(2)] == [0, WINDOW]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_hf(folders: dict[str, Path], case: str, backend: str) -> None:
    ids = fixture_prompt(40)
    ours = prefill(load_ours(folders[case], backend=backend), ids)
    assert ours.shape == (40, 1024)
    assert (ours - reference_logits(folders[case], ids)).abs().max().item() <= 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["qwen3", "mistral_window", "phi3_window", "gemma2", "gemma3"])
def test_greedy_generation_matches_hf(folders: dict[str, Path], case: str, backend: str) -> None:
    ids = fixture_prompt(20, seed=2)
    assert greedy(load_ours(folders[case], backend=backend), ids, 16) == reference_greedy(folders[case], ids, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["gemma2", "gemma3", "mistral_window", "qwen3"])
def test_extend_on_cached_prefix_and_mixed_batches_match_cold_runs(
    folders: dict[str, Path], case: str, backend: str
) -> None:
    model = load_ours(folders[case], backend=backend)
    prefix, tail = fixture_prompt(19, seed=6), fixture_prompt(13, seed=7)
    pool, allocator = make_pool(model.config)
    alloc(allocator, 5)  # the cached run's slots are not the cold run's, nor contiguous with them
    prefix_slots = alloc(allocator, 19).flip(0)
    model(make_batch("extend", [(prefix, prefix_slots)]), pool)
    context = torch.cat([prefix_slots, alloc(allocator, 13)])
    cached = model(make_batch("extend", [(tail, context)]), pool, return_all_logits=True)
    cold = prefill(model, prefix + tail)
    assert (cached - cold[19:]).abs().max().item() <= 1e-4
    # a mixed batch: prompts of different lengths in one extend, then one ragged decode step
    prompts = [fixture_prompt(5, seed=3), fixture_prompt(23, seed=4), fixture_prompt(12, seed=5)]
    contexts = [alloc(allocator, len(p)) for p in prompts]
    batched = model(make_batch("extend", list(zip(prompts, contexts))), pool)
    contexts = [torch.cat([c, alloc(allocator, 1)]) for c in contexts]
    batched_decode = model(make_batch("decode", [([7 + i], c) for i, c in enumerate(contexts)]), pool)
    for i, ids in enumerate(prompts):
        alone = prefill(model, ids + [7 + i])
        assert (batched[i] - alone[-2]).abs().max().item() <= 1e-4
        assert (batched_decode[i] - alone[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["gemma2", "gemma3", "mistral_window", "qwen3"])
def test_last_rows_tail_and_mixed_steps_match_whole_runs(folders: dict[str, Path], case: str, backend: str) -> None:
    """Steps past TAIL_MIN_ROWS (the last layer goes on with a tail of rows) and a mixed step (a prefill chunk
    next to decodes) give the logits of whole-row runs."""
    model = load_ours(folders[case], backend=backend)
    prompts = [fixture_prompt(50, seed=11), fixture_prompt(41, seed=12)]
    pool, allocator = make_pool(model.config)
    contexts = [alloc(allocator, len(p)) for p in prompts]
    last_rows = model(make_batch("extend", list(zip(prompts, contexts))), pool)
    for i, ids in enumerate(prompts):
        assert (last_rows[i] - prefill(model, ids)[-1]).abs().max().item() <= 1e-4
    # mixed: request 0 decodes one token while a new prompt prefills a 30-token chunk
    chunk = fixture_prompt(30, seed=13)
    decode_context = torch.cat([contexts[0], alloc(allocator, 1)])
    items = [([5], decode_context), (chunk, alloc(allocator, 30))]
    mixed = model(make_batch("mixed", items), pool)
    assert (mixed[0] - prefill(model, prompts[0] + [5])[-1]).abs().max().item() <= 1e-4
    assert (mixed[1] - prefill(model, chunk)[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "qwen3", "phi3_window"])
def test_bfloat16_and_quantized_models_stay_close_to_float32(folders: dict[str, Path], case: str) -> None:
    """bf16 weights and pool, int8 and q4_1 weights: no crash, logits near float32's (tiny random models
    amplify rounding; bounds about twice what was measured)."""
    ids = fixture_prompt(30, seed=14)
    reference = prefill(load_ours(folders[case]), ids)
    bf16 = load_ours(folders[case], torch.bfloat16)
    pool, allocator = make_pool(bf16.config, dtype=torch.bfloat16)
    out = bf16(make_batch("extend", [(ids, alloc(allocator, 30))]), pool, return_all_logits=True)
    for model, bound in ((None, 0.05), ("int8", 0.05), ("q4_1", 0.5)):
        if model is not None:
            quantized = load_ours(folders[case])
            quantized.quantize(model)
            out = prefill(quantized, ids)
        assert float((out - reference).norm() / reference.norm()) <= bound, model
