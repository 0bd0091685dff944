"""The core install: the engine, the server and the benchmarks import without the extras.

Each check runs in a fresh interpreter where ``ray`` and ``matplotlib`` cannot be
imported (a ``None`` in ``sys.modules`` makes their import fail). tqdm is in the
``[bench]`` extra too, but transformers depends on it, so the core has it anyway.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The checkout's root: the benchmarks are imported from it, not from the installed package.
ROOT = Path(__file__).resolve().parents[1]
BLOCK = "import sys\nfor name in ('ray', 'matplotlib'):\n    sys.modules[name] = None\n"


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_engine_server_and_benchmarks_import_without_the_extras() -> None:
    out = run(
        "import radixserve.engine, radixserve.server.launch, radixserve.server.app, radixserve.cli\n"
        "import benchmarks.serve, benchmarks.simulate, benchmarks.four_way\n"
        "from radixserve.server.args import parse_args\n"
        "assert parse_args(['--replicas', '2']).replicas == 2\n"
        "print('ok')"
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_replicas_without_ray_name_the_extra() -> None:
    out = run("from radixserve.cli import main\nmain(['serve', '--replicas', '2'])")
    assert out.returncode == 1 and "needs the [router] extra" in out.stderr, out.stderr


def test_a_plot_without_matplotlib_names_the_extra() -> None:
    out = run("from benchmarks.simulate import plot\nplot([], 'never-written.png', 'title')")
    assert out.returncode == 1 and "needs the [bench] extra" in out.stderr, out.stderr
