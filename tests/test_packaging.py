"""What ``pip install radixserve`` ships: the engine and the server; the benchmarks and the tests stay in the checkout.

``radixserve bench`` is an entry point into the checkout's ``benchmarks`` package: it finds
it beside the package it was imported from, and without a checkout it says where the
benchmarks live. Each run is a fresh, isolated interpreter (``-I``: neither PYTHONPATH nor
the working directory on its path) that reaches the package through a folder of its own.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_package_alone() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = setuptools.find_packages(str(ROOT), include=config["tool"]["setuptools"]["packages"]["find"]["include"])
    assert "radixserve" in packages and "radixserve.server" in packages
    assert [name for name in packages if name.split(".")[0] != "radixserve"] == []


def test_the_package_imports_neither_benchmarks_nor_tests() -> None:
    found = []
    for path in sorted((ROOT / "radixserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [
                f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in ("benchmarks", "tests")
            ]
    assert found == []


def run_bench(site: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys\nsys.path.insert(0, {str(site)!r})\nfrom radixserve.cli import main\nmain({list(argv)!r})"
    return subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=site, timeout=300, check=False
    )


def test_bench_finds_the_benchmarks_beside_the_package(tmp_path: Path) -> None:
    # An editable install's console script: the package is reached without the checkout on the path.
    (tmp_path / "radixserve").symlink_to(ROOT / "radixserve", target_is_directory=True)
    out = run_bench(tmp_path, "bench", "cache-ops", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: radixserve bench cache-ops"), out.stderr


def test_bench_without_a_checkout_says_where_the_benchmarks_live(tmp_path: Path) -> None:
    # An installed wheel: the package alone, nothing beside it.
    shutil.copytree(ROOT / "radixserve", tmp_path / "radixserve", ignore=shutil.ignore_patterns("__pycache__"))
    out = run_bench(tmp_path, "bench", "cache-ops")
    assert out.returncode == 1, out.stderr
    assert "not part of the installed package" in out.stderr and "python -m benchmarks NAME" in out.stderr
