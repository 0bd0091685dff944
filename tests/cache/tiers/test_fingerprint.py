"""The cache directory's fingerprint changes with anything that changes the K/V a token gets."""

from __future__ import annotations

from pathlib import Path

from radixserve import Engine
from radixserve.cache.tiers.build import files_digest


def test_files_digest_sees_one_changed_byte_and_a_renamed_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.safetensors").write_bytes(bytes(range(256)) * 100)
    (model / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    before = files_digest(model)
    assert files_digest(model) == before
    data = bytearray((model / "weights.safetensors").read_bytes())
    data[12_345] ^= 1
    (model / "weights.safetensors").write_bytes(bytes(data))
    flipped = files_digest(model)
    assert flipped != before
    (model / "tokenizer.json").rename(model / "tokenizer2.json")
    assert files_digest(model) != flipped
    single = tmp_path / "m.gguf"
    single.write_bytes(b"GGUF" + bytes(100))
    assert files_digest(single) != files_digest(model)


def test_the_fingerprint_records_the_resolved_quantization(tiny_model_dir: Path, tmp_path: Path) -> None:
    """auto becomes a method per file and machine: the directory must name what ran, never "auto"."""
    engine = Engine.create(model_path=str(tiny_model_dir), max_total_tokens=64, cache_dir=str(tmp_path / "kv"))
    info = engine.describe()
    assert info["quantization"] == "auto" and info["resolved_quantization"] == "none"
    assert info["quantization_reason"] == "auto: none, a float checkpoint (its weights as stored)"
    assert engine.cache.tiers is not None and engine.cache.tiers.disk is not None
    assert engine.cache.tiers.disk.fingerprint["quantization"] == "none"
    explicit = Engine.create(
        model_path=str(tiny_model_dir), max_total_tokens=64, quantization="q4_1", cache_dir=str(tmp_path / "kv2")
    )
    assert explicit.cache.tiers is not None and explicit.cache.tiers.disk is not None
    assert explicit.cache.tiers.disk.fingerprint["quantization"] == "q4_1"
