"""What the package imports.

Start-up: building a model and a GGUF's tokenizer pulls in none of the heavy modules only some
paths need (measured: torch._dynamo + sympy 3-5 s, transformers' AutoTokenizer 1.3 s, xgrammar
0.4 s). Checked in a fresh interpreter, where nothing has imported them yet.

Layers: every module's imports, read with ``ast`` (lazy and TYPE_CHECKING ones included),
respect DESIGN.md's floors; nothing in the package imports tests or benchmarks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.model.test_tokenizer_gguf import write_tokenizer_gguf

PROBE = """
import sys
import torch
from radixserve.engine.engine import Engine
from radixserve.model.config import ModelConfig
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.tokenizer import Tokenizer

config = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
model = LlamaForCausalLM(config, attention_backend="reference")
assert model.embed_tokens.weight.shape == (300, 64) and type(model.embed_tokens) is torch.nn.Embedding
assert type(model.lm_head) is torch.nn.Linear
Tokenizer.from_gguf(sys.argv[1])
heavy = ("torch._dynamo", "sympy", "transformers.models.auto.tokenization_auto", "xgrammar")
print(sorted(name for name in heavy if name in sys.modules))
"""


def test_building_a_model_and_a_gguf_tokenizer_imports_nothing_heavy(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", "smollm")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True, cwd=Path.cwd()
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


# ---- the layers: no import runs back up ----------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "radixserve"
# DESIGN.md's floors, bottom up: a module imports its own package and the floors below it, never one
# beside it (cache and model know nothing of each other) or above it.
FLOORS = {
    "core": 0,
    "memory": 0,
    "extras": 0,
    "cache": 1,
    "model": 1,
    "kv_events": 2,  # the cache's events on the wire
    "scheduler": 2,
    "engine": 3,
    "server": 4,
    "router": 5,  # runs servers as replicas
    "__init__": 6,  # `from radixserve import Engine`: the public face, never imported from inside
    "cli": 7,  # the entry points
    "__main__": 8,
}
OUTSIDE = ("tests", "benchmarks")  # never imported by the package


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in one file, function-level and TYPE_CHECKING ones too."""
    package = ["radixserve", *path.relative_to(PACKAGE).with_suffix("").parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            yield node.lineno, ".".join([*base, *([node.module] if node.module else [])])


def floor_of(module: str) -> str:
    """The layer a radixserve module belongs to: its top-level package (or module) under radixserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = floor_of(".".join(["radixserve", *path.relative_to(PACKAGE).with_suffix("").parts]))
        if source not in FLOORS:
            problems.append(f"{path.relative_to(PACKAGE.parent)}: radixserve/{source} has no floor in FLOORS")
            continue
        for line, module in imported_modules(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
            if module.split(".")[0] in OUTSIDE:
                problems.append(f"{where}: the package never imports {module.split('.')[0]}/")
            if module.split(".")[0] != "radixserve":
                continue
            target = floor_of(module)
            if target != source and FLOORS.get(target, len(FLOORS)) >= FLOORS[source]:
                problems.append(f"{where}: {source} may import only the floors below it")
    return problems


def test_no_import_runs_back_up_the_layers() -> None:
    assert layer_violations() == []


def test_the_layer_check_sees_an_import_that_runs_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a copy of the package with a scheduler module that imports the server fails it."""
    fake = tmp_path / "radixserve"
    for name, text in (
        ("__init__.py", ""),
        ("scheduler/__init__.py", "from . import loop\n"),
        ("scheduler/loop.py", "from radixserve.server.args import ServerArgs\nfrom ..cache import key\n"),
        ("engine/step.py", "def f() -> None:\n    from tests.support import fixture\n"),
    ):
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    problems = layer_violations()
    assert len(problems) == 2, problems
    assert "scheduler/loop.py:1 imports radixserve.server.args" in problems[1]
    assert "engine/step.py:2 imports tests.support" in problems[0]
