"""The cache directory's fingerprint changes with anything that changes the K/V a token gets."""

from __future__ import annotations

from pathlib import Path

from radixserve.engine.tiers import files_digest


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
