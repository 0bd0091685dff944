"""``--quantization auto`` and loading a GGUF's blocks without dequantizing them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve.model import gguf_loader
from radixserve.model.gguf_loader import GGUFFile, load_gguf, load_gguf_blocks
from radixserve.model.kept_weights import usable_blocks
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.precision import resolve_quantization
from radixserve.model.quant_blocks import BlockLinear
from tests.model.tiny import alloc, make_batch, make_pool

Q4_1, Q8_0, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny GGUFs carry no vocabulary: these tests are about weights."""
    monkeypatch.setattr("radixserve.model.loader.Tokenizer.from_model_path", lambda path, gguf_reader=None: None)


def test_auto_keeps_a_gguf_stored_as_q4_1_and_q8_0_blocks(q4_gguf: Path) -> None:
    types = GGUFFile(q4_gguf).matrix_types()
    assert types["model.embed_tokens.weight"] == "Q8_0" and "model.norm.weight" not in types  # tied: the lm_head
    method, reason = resolve_quantization("auto", CPU, types, block_kernel=True)
    assert method == "q4_1-exact" and "14 Q4_1, 1 Q8_0" in reason and "lossless" in reason


def test_auto_keeps_what_it_can_or_falls_back_to_none_and_says_why(mixed_gguf: Path) -> None:
    types = GGUFFile(mixed_gguf).matrix_types()
    method, reason = resolve_quantization("auto", CPU, types, block_kernel=True)
    assert method == "q4_1-exact" and "4 F32, 10 Q4_1, 1 Q8_0: kept as the file stores them" in reason  # F32: rows
    method, reason = resolve_quantization("auto", CPU, {"a": "Q4_1", "b": "MXFP4"}, block_kernel=True)
    assert method == "q4_1-exact" and "MXFP4 have no kernel: dequantized to floats, lossless" in reason
    method, reason = resolve_quantization("auto", CPU, {"a": "IQ4_NL", "b": "MXFP4"}, block_kernel=True)
    assert method == "none" and "IQ4_NL, MXFP4 cannot stay as stored" in reason  # nothing to keep
    blocks_only = {"w": "Q4_1"}
    assert resolve_quantization("auto", torch.device("cuda"), blocks_only)[0] == "none"
    assert "CPU-only" in resolve_quantization("auto", torch.device("cuda"), blocks_only)[1]
    assert resolve_quantization("auto", CPU, blocks_only, block_kernel=False) == (
        "none",
        "auto: none, the block kernel did not build (see the log; GGUF matrices: 1 Q4_1)",
    )
    assert resolve_quantization("auto", CPU, None)[0] == "none"  # an HF float checkpoint
    assert resolve_quantization("int8", CPU, blocks_only) == ("int8", "int8 as asked")


def test_load_model_resolves_auto_and_reports_the_reason(q4_gguf: Path, mixed_gguf: Path) -> None:
    loaded = load_model(str(q4_gguf), CPU, torch.float32, quantization="auto")
    assert isinstance(loaded, LoadedModel)
    if loaded.model.quantization == "q4_1-exact":  # where the block kernel builds
        assert loaded.quantization_reason.startswith("auto: q4_1-exact,")
        assert loaded.model.quantization_detail.startswith("q4_1-exact: 14 of 14 linear weights kept")
    else:
        assert "did not build" in loaded.quantization_reason
    mixed = load_model(str(mixed_gguf), CPU, torch.float32, quantization="auto")
    assert mixed.model.quantization == loaded.model.quantization and "F32" in mixed.quantization_reason


def test_kept_blocks_are_never_dequantized_at_load(q4_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the tensors the model holds as floats (norms here) are dequantized: the matrices stay blocks."""
    read: list[str] = []
    dequantize = gguf_loader._dequantize

    def spy(info: gguf.ReaderTensor) -> np.ndarray:
        read.append(info.name)
        return dequantize(info)

    monkeypatch.setattr(gguf_loader, "_dequantize", spy)
    load_model(str(q4_gguf), CPU, torch.float32, quantization="q4_1")
    assert read and all(name.endswith("norm.weight") for name in read), read


def old_path(path: Path) -> LlamaForCausalLM:
    """The q4_1 load before: every tensor dequantized and loaded, then the blocks swapped in."""
    config, tensors = load_gguf(path)
    model = LlamaForCausalLM(config)
    model.load_weights(tensors)
    model.quantize("q4_1", load_gguf_blocks(path))
    return model


@pytest.mark.parametrize("name", ["q4_gguf", "mixed_gguf"])
def test_loading_the_blocks_directly_gives_the_same_model(name: str, request: pytest.FixtureRequest) -> None:
    """Weights and logits bit for bit as the dequantize-everything load; on the mixed file a fused linear
    with a float part is quantized from the dequantized floats, as before."""
    path = request.getfixturevalue(name)
    new = load_model(str(path), CPU, torch.float32, quantization="q4_1").model
    old = old_path(path)
    assert new.quantization_detail == old.quantization_detail
    new_state, old_state = new.state_dict(), old.state_dict()
    assert new_state.keys() == old_state.keys()
    assert all(torch.equal(new_state[k], old_state[k]) for k in new_state), [
        k for k in new_state if not torch.equal(new_state[k], old_state[k])
    ]
    ids = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    logits = []
    for model in (new, old):
        pool, allocator = make_pool(model.config)
        logits.append(model(make_batch("extend", [(ids, alloc(allocator, 12))]), pool, return_all_logits=True))
    assert torch.equal(logits[0], logits[1])


def test_load_blocks_refuses_blocks_it_would_not_keep_and_changes_nothing(mixed_gguf: Path) -> None:
    file = GGUFFile(mixed_gguf)
    blocks = file.blocks()
    del blocks["model.layers.0.self_attn.k_proj.weight"]  # as if k were of a type not kept: q and v cannot be
    usable = usable_blocks(blocks, file.config.num_layers)
    assert "model.layers.0.self_attn.q_proj.weight" in blocks  # q is Q4_1, but k shares its fused linear
    assert "model.layers.0.self_attn.q_proj.weight" not in usable
    assert "model.layers.0.self_attn.o_proj.weight" in usable
    model = LlamaForCausalLM(file.config)
    model.load_weights(file.tensors())  # defined weights: a new model's are uninitialised memory
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="would not keep.*q_proj"):
        model.load_blocks(file.tensors(skip=usable.keys()), blocks)
    wrong = dict(usable)
    wrong["model.layers.0.self_attn.o_proj.weight"] = usable["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="o_proj.weight: q4_1 blocks of shape"):
        model.load_blocks(file.tensors(skip=usable.keys()), wrong)
    assert model.quantization == "none" and not any(isinstance(m, BlockLinear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
