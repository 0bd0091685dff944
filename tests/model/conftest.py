"""GGUF files of the tiny Llama (tests/model/test_gguf.py's) stored as the quantized tests need them."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tests.model.test_gguf import _write_tiny_llama

Q4_1, Q8_0, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer matrix Q4_1, the embedding (tied lm_head) Q8_0, norms F32: as the embedded SmolLM2 GGUF."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf"
    _write_tiny_llama(path, layer_types={Q8_0: Q4_1, F32: Q4_1})
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its Q8_0 layer matrices stored as Q4_1: per layer q, v, o, gate and down Q4_1, k and up F32; the embedding
    (tied lm_head) Q8_0."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf"
    _write_tiny_llama(path, layer_types={Q8_0: Q4_1})
    return path
