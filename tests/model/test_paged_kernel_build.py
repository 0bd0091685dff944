"""Where the C++ kernel is built: one folder per source fingerprint, compiled from a copy of csrc/ kept
there, so checkouts (worktrees, a CI clone) never rebuild or overwrite each other's library.

Nothing is compiled here: ``cpp_extension.load`` is replaced by a recorder.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils import cpp_extension

from radixserve.model import paged_kernel


def _checkout(root: Path) -> Path:
    """A copy of csrc/ as another checkout would have it."""
    return Path(shutil.copytree(paged_kernel.CSRC, root / "radixserve" / "model" / "csrc"))


def test_fingerprint_follows_every_source_file_not_the_checkout(tmp_path: Path) -> None:
    here, there = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    assert paged_kernel.build_fingerprint(here) == paged_kernel.build_fingerprint(there)
    assert paged_kernel.build_fingerprint(here) == paged_kernel.build_fingerprint()
    header = next(p for p in sorted(there.iterdir()) if p.suffix == ".h")  # included, not compiled: counts too
    header.write_text(header.read_text() + "\n// another checkout's edit\n")
    assert paged_kernel.build_fingerprint(here) != paged_kernel.build_fingerprint(there)
    (here / "new_kernel.h").write_text("// a file SOURCES does not name yet\n")
    assert paged_kernel.build_fingerprint(here) != paged_kernel.build_fingerprint()


def test_sources_are_staged_once_and_never_rewritten(tmp_path: Path) -> None:
    build_dir = tmp_path / "radixserve_paged_x"
    build_dir.mkdir()
    staged = paged_kernel.stage_sources(build_dir)
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in paged_kernel.CSRC.iterdir())
    assert all((staged / p.name).read_bytes() == p.read_bytes() for p in paged_kernel.CSRC.iterdir())
    mtimes = {p.name: p.stat().st_mtime_ns for p in staged.iterdir()}
    assert paged_kernel.stage_sources(build_dir) == staged
    assert {p.name: p.stat().st_mtime_ns for p in staged.iterdir()} == mtimes  # ninja sees nothing new
    assert [p.name for p in build_dir.iterdir()] == ["src"]  # no scratch folder left behind


@pytest.fixture
def recorded_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[dict[str, Any]]]:
    """``paged_kernel.load()`` with torch's compile replaced by a recorder and the cache in tmp_path."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(paged_kernel, "build_directory", _mkdir(tmp_path / "ext"))
    paged_kernel.load.cache_clear()
    yield calls
    paged_kernel.load.cache_clear()  # the next caller loads the real kernel


def _mkdir(root: Path) -> Any:
    def build_directory(name: str) -> Path:
        (root / name).mkdir(parents=True, exist_ok=True)
        return root / name

    return build_directory


def test_load_compiles_the_staged_copy_in_the_fingerprinted_folder(recorded_load: list[dict[str, Any]]) -> None:
    assert paged_kernel.load()
    (call,) = recorded_load
    build_dir = Path(call["build_directory"])
    assert call["name"] == build_dir.name == f"radixserve_paged_{paged_kernel.build_fingerprint()}"
    sources = [Path(s) for s in call["sources"]]
    assert sources and all(s.parent == build_dir / "src" and s.is_file() for s in sources)
    assert [s.name for s in sources] == [p.name for p in paged_kernel.SOURCES if p.suffix == ".cpp"]
    assert not any(str(paged_kernel.CSRC) in s for s in call["sources"])  # never the checkout's own path


@pytest.mark.parametrize("state", ["built", "building", "broken"])
def test_a_finished_build_loads_without_torchs_build_step(
    recorded_load: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, state: str
) -> None:
    name = f"radixserve_paged_{paged_kernel.build_fingerprint()}"
    library = paged_kernel.build_directory(name) / f"{name}.so"
    library.write_bytes(b"")  # stands for the library: load_library is replaced below
    if state == "building":
        (library.parent / "lock").touch()  # torch's baton while a build runs
    loaded: list[str] = []

    def load_library(path: str) -> None:
        if state == "broken":
            raise OSError(f"Could not load this library: {path}")
        loaded.append(path)

    monkeypatch.setattr(paged_kernel.torch.ops, "load_library", load_library)
    assert paged_kernel.load()
    if state == "built":
        assert loaded == [str(library)] and not recorded_load
    else:  # torch's build step runs (and waits for the running build or rebuilds)
        assert not loaded and len(recorded_load) == 1


def test_build_directory_is_torchs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The folder torch's own extension loader would pick (a CPU build of torch), found without importing it."""
    if paged_kernel.torch.version.cuda is None and paged_kernel.torch.version.hip is None:
        name = "radixserve_paged_probe"
        assert paged_kernel.build_directory(name) == Path(cpp_extension._get_build_directory(name, verbose=False))
        paged_kernel.build_directory(name).rmdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert paged_kernel.build_directory("x") == tmp_path / "x" and (tmp_path / "x").is_dir()


def _aged(folder: Path, days: float, *names: str) -> Path:
    """``folder`` with ``names`` in it, each last modified ``days`` ago."""
    folder.mkdir(parents=True, exist_ok=True)
    when = time.time() - days * 86400
    for name in names:
        (folder / name).touch()
        os.utime(folder / name, (when, when))
    return folder


def test_a_new_build_removes_only_builds_unused_for_the_cutoff(tmp_path: Path) -> None:
    keep = _aged(tmp_path / "radixserve_paged_new", 100, "radixserve_paged_new.so")
    stale = _aged(tmp_path / "radixserve_paged_old", 30, "radixserve_paged_old.so", "used")
    never_stamped = _aged(tmp_path / "radixserve_paged_unstamped", 30, "radixserve_paged_unstamped.so")
    recently_used = _aged(tmp_path / "radixserve_paged_busy", 30, "radixserve_paged_busy.so")
    _aged(recently_used, 1, "used")  # an old build a process loaded yesterday
    building = _aged(tmp_path / "radixserve_paged_building", 30, "lock")
    other = _aged(tmp_path / "someone_elses_ext", 30, "lib.so")
    removed = paged_kernel.prune_stale_builds(keep, max_age_days=14)
    assert sorted(removed) == sorted([stale, never_stamped])
    assert not stale.exists() and not never_stamped.exists()
    assert keep.is_dir() and recently_used.is_dir() and building.is_dir() and other.is_dir()


def test_loads_stamp_their_build_and_a_new_build_prunes(recorded_load: list[dict[str, Any]], tmp_path: Path) -> None:
    old = _aged(tmp_path / "ext" / "radixserve_paged_old", 30, "radixserve_paged_old.so", "used")
    assert paged_kernel.load()
    (call,) = recorded_load
    build_dir = Path(call["build_directory"])
    assert (build_dir / "used").is_file() and time.time() - (build_dir / "used").stat().st_mtime < 3600
    assert not old.exists()
