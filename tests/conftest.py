"""Test-wide settings: one torch thread; deterministic hypothesis runs by default (CI must not flake).

`HYPOTHESIS_PROFILE=explore pytest ...` runs many more random examples, for hunting bugs.
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.model.tiny import build_byte_engine_folder, build_engine_folder
from tests.support.archs import build_arch_folder
from tests.support.server_process import ServerProcess

# One thread: libgomp's spinning pool makes 2 threads 3-50x slower on a busy 2-core box.
torch.set_num_threads(1)

# Servers the tests start compare tokens exactly (stream vs whole, cache hit vs cold): float32, the
# same on every CPU. `--dtype auto` would be bfloat16 on a CPU with AMX or AVX512-BF16, where a
# different split of the same tokens rounds differently. tests/model/test_precision.py covers auto.
ServerProcess.base_flags = ("--dtype", "float32")

settings.register_profile(
    "default",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama + word tokenizer as an HF folder named ``tiny-llama`` (built once)."""
    return build_engine_folder(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def byte_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama over a byte-level tokenizer (any text encodes): grammars, SGLang programs."""
    return build_byte_engine_folder(tmp_path_factory.mktemp("models") / "tiny-byte-llama")


@pytest.fixture(scope="session")
def arch_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """(fixture name of tests/support/archs.py SPECS: "qwen2", "gemma3", ..., **config overrides) -> its tiny
    HF folder, built once per name and overrides for the whole session."""
    built: dict[str, Path] = {}

    def folder(name: str, **overrides: Any) -> Path:
        key = f"{name} {sorted(overrides.items())!r}"
        if key not in built:
            built[key] = build_arch_folder(name, tmp_path_factory.mktemp("archs") / name, **overrides)
        return built[key]

    return folder
