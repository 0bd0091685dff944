"""tests/support/kquants.py (llama.cpp's K-quant quantizers in numpy) against gguf-py's dequantizers and llama.cpp.

Bytes equal to ``llama-quantize``'s where a build is at hand (``LLAMA_QUANTIZE``, or llama.cpp built under
/work/llamacpp as BENCHMARKS.md describes): a tiny F32 Llama quantized by both, tensor by tensor, pure and
with the Q4_K_M / Q5_K_M / Q6_K per-tensor mix. Without one, the round trip and the block layout only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from radixserve.model.gguf_loader import default_model_path
from tests.support import kquants
from tests.support.gguf_rewrite import fallback_type, preset_tensor_types, requantize_gguf, rewrite_gguf

Q4_K, Q5_K, Q6_K = kquants.Q4_K, kquants.Q5_K, kquants.Q6_K
# type -> (max error in steps of the super-block's coarsest sub-block, max RMS error / RMS of gaussian values).
# Measured: 0.78-1.0 and 0.072 (Q4_K), 0.80-1.0 and 0.036 (Q5_K), 0.52-0.58 and 0.018 (Q6_K), on gaussian,
# uniform and Student-t(2) values.
BOUNDS = {Q4_K: (1.25, 0.08), Q5_K: (1.25, 0.042), Q6_K: (0.75, 0.022)}
LEVELS = {Q4_K: 15, Q5_K: 31, Q6_K: 32}


def llama_quantize() -> str | None:
    found = os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize")
    default = Path("/work/llamacpp/build/bin/llama-quantize")
    return found or (str(default) if default.exists() else None)


def test_the_running_sum_adds_in_order() -> None:
    """The port's sums rest on numpy adding row after row over axis 0 (it sums pairwise only along a row)."""
    values = np.random.default_rng(0).standard_t(2, (32, 4099)).astype(np.float32) * 1e3
    looped = values[0].copy()
    for row in values[1:]:
        looped += row
    assert np.array_equal(kquants._running_sum(values), looped)


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["gauss", "uniform", "heavy"])
def test_round_trip_through_gguf_dequantize_is_within_the_types_bound(
    qtype: gguf.GGMLQuantizationType, kind: str
) -> None:
    rng = np.random.default_rng(len(kind))
    values = {
        "gauss": rng.standard_normal,
        "uniform": lambda s: rng.uniform(-1, 3, s),
        "heavy": lambda s: rng.standard_t(2, s),
    }
    x = values[kind]((64, 1024)).astype(np.float32)
    back = gguf.quants.dequantize(kquants.quantize(x, qtype), qtype)
    width = 16 if qtype == Q6_K else 32
    sub = x.reshape(-1, width)
    span = np.abs(sub).max(1) if qtype == Q6_K else np.maximum(sub.max(1), 0) - np.minimum(sub.min(1), 0)
    coarsest_step = (span / LEVELS[qtype]).reshape(-1, 256 // width).max(1)
    steps = np.abs(back - x).reshape(-1, 256).max(1) / coarsest_step
    max_steps, max_rms = BOUNDS[qtype]
    assert steps.max() <= max_steps
    if kind == "gauss":
        assert np.sqrt(np.mean((back - x) ** 2)) <= max_rms * np.sqrt(np.mean(x**2))


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K], ids=lambda t: t.name)
def test_block_layout(qtype: gguf.GGMLQuantizationType) -> None:
    """Rows of whole 256-value blocks of the type's size; float16 scales finite (K: d, dmin >= 0); zero rows
    all-zero blocks; a row not of whole blocks refused."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal((5, 512)), np.zeros((1, 512))]).astype(np.float32)
    raw = kquants.quantize(x, qtype)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    assert raw.dtype == np.uint8 and raw.shape == (6, 2 * block_bytes)
    blocks = raw.reshape(-1, block_bytes)
    scales = blocks[:, -2:] if qtype == Q6_K else blocks[:, :4]
    halves = scales.copy().view(np.float16)
    assert np.isfinite(halves).all() and (qtype == Q6_K or (halves >= 0).all())
    assert not raw[5].any()
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize(x[:, :288], qtype)


def test_fallback_types_follow_llama_cpp() -> None:
    assert [fallback_type(t, 576) for t in (Q4_K, Q5_K, Q6_K)] == [
        gguf.GGMLQuantizationType[n] for n in ("Q5_0", "Q5_1", "Q8_0")
    ]
    assert fallback_type(Q4_K, 1536) == Q4_K and fallback_type(Q6_K, 40) == gguf.GGMLQuantizationType.F16


def awkward_rows(rng: np.random.Generator, weight: np.ndarray) -> np.ndarray:
    """``weight`` with its first rows made the cases a quantizer gets wrong: zeros, one constant (negative:
    a flat block with a min), all positive, mostly zero, small integers, heavy tails, values near 1e-30."""
    columns = weight.shape[1]
    weight[0] = 0
    weight[1] = -0.3
    weight[2] = np.abs(weight[2])
    weight[3] *= rng.random(columns) < 0.1
    weight[4] = rng.integers(-8, 8, columns)
    weight[5] = rng.standard_t(1, columns)
    weight[6] *= 1e-30
    weight[7, : columns // 2] = 0  # a zero super-block beside a live one
    return weight


def write_tiny_llama(path: Path, layers: int = 8) -> Path:
    """A random F32 Llama llama-quantize can read: hidden 256 (K-quant rows), ffn 288 (ffn_down falls back)."""
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        (writer.add_block_count, layers),
        (writer.add_context_length, 64),
        (writer.add_embedding_length, 256),
        (writer.add_feed_forward_length, 288),
        (writer.add_head_count, 4),
        (writer.add_head_count_kv, 2),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_file_type, gguf.LlamaFileType.ALL_F32),
    ):
        add(value)
    shapes = {
        "attn_q": (256, 256),
        "attn_k": (128, 256),
        "attn_v": (128, 256),
        "attn_output": (256, 256),
        "ffn_gate": (288, 256),
        "ffn_up": (288, 256),
        "ffn_down": (256, 288),
    }
    writer.add_tensor("token_embd.weight", awkward_rows(rng, rng.standard_normal((64, 256)).astype(np.float32)))
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    for i in range(layers):
        for name, shape in shapes.items():
            weight = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            writer.add_tensor(f"blk.{i}.{name}.weight", awkward_rows(rng, weight) if name == "attn_q" else weight)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensors_of(path: Path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.skipif(llama_quantize() is None, reason="no llama-quantize (LLAMA_QUANTIZE) to compare with")
@pytest.mark.parametrize(
    ("ftype", "pure"),
    [("Q4_K", True), ("Q5_K", True), ("Q6_K", True), ("Q4_K_M", False), ("Q5_K_M", False), ("Q6_K", False)],
)
def test_the_port_writes_llama_quantizes_bytes(ftype: str, pure: bool, tmp_path: Path) -> None:
    """Every tensor of the tiny Llama: the same type and bytes as llama-quantize's (pure: one type, with the
    shape fallback; else the preset's per-tensor mix, which preset_tensor_types mirrors)."""
    source = write_tiny_llama(tmp_path / "f32.gguf")
    theirs = tmp_path / "llama.gguf"
    preset = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}.get(ftype, ftype)
    command = [str(llama_quantize()), *(["--pure"] if pure else []), str(source), str(theirs), preset, "1"]
    subprocess.run(command, check=True, capture_output=True)
    ours = (
        rewrite_gguf(source, tmp_path / "ours.gguf", ftype)
        if pure
        else requantize_gguf(source, tmp_path / "ours.gguf", preset)
    )
    expected, got = tensors_of(theirs), tensors_of(ours)
    assert expected.keys() == got.keys()
    for name in expected:
        assert got[name][0] == expected[name][0], name
        assert got[name][1] == expected[name][1], name
    if not pure:
        assert len({t.name for t in preset_tensor_types(gguf.GGUFReader(source), preset).values()}) >= 2


@pytest.fixture(scope="module")
def smollm2() -> gguf.GGUFReader:
    return gguf.GGUFReader(default_model_path())


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("Q4_K_M", {"Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15}),
        ("Q5_K_M", {"Q5_K": 16, "Q5_1": 166, "Q6_K": 14, "Q8_0": 15}),
        ("Q6_K", {"Q6_K": 30, "Q8_0": 181}),
        ("Q4_0", {"Q4_0": 210, "Q8_0": 1}),
    ],
)
def test_preset_types_on_smollm2_are_llama_quantizes(
    preset: str, expected: dict[str, int], smollm2: gguf.GGUFReader
) -> None:
    """The per-type counts of llama-quantize's files from the embedded SmolLM2 (576-wide rows fall back; the
    tied embedding is Q8_0; ffn_down and attn_v get Q6_K in the 14 layers use_more_bits picks of 30)."""
    types = preset_tensor_types(smollm2, preset)
    assert Counter(t.name for t in types.values()) == expected
    more_bits = [i for i in range(30) if types[f"blk.{i}.ffn_down.weight"] == gguf.GGMLQuantizationType.Q6_K]
    picked = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert more_bits == {"Q6_K": list(range(30)), "Q4_0": []}.get(preset, picked)
