"""``radixserve bench peer-serve`` on a tiny fixture: the table's bookkeeping, not its speed.

No llama.cpp here: a stand-in ``llama-server`` (a script that takes llama-server's flags and serves the same
file with radixserve) checks the command the benchmark starts and that every cell is a cold, completed run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.peer_serve import main
from tests.support.archs import gguf_path

FAKE_LLAMA_SERVER = f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
print(" ".join(args), file=open(sys.argv[0] + ".log", "a"))
model, port = args[args.index("-m") + 1], args[args.index("--port") + 1]
os.execv({sys.executable!r}, [{sys.executable!r}, "-m", "radixserve", "serve", "--model-path", model, "--port", port])
"""
SMALL = ["--num-requests", "4", "--prompt-len", "48", "--vocab-size", "1024", "--concurrency", "2"]


def rows(printed: str) -> list[dict[str, str]]:
    lines = [line for line in printed.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]


def test_each_cell_a_cold_server_and_the_ratio_to_the_peer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER)
    fake.chmod(0o755)
    path = gguf_path("llama3")
    main(["--model-path", str(path), "--llama-server", str(fake), *SMALL])
    table = rows(capsys.readouterr().out)
    cells = [(r["server"], r["workload"], r["c"]) for r in table]
    expected = [(s, w, c) for w in ("shared", "no-sharing") for c in ("2",) for s in ("llama.cpp", "radixserve")]
    assert cells == expected
    for r in table:
        assert r["file"] == path.name
        done, sent = r["done"].split("/")
        assert done == sent == ("4" if r["workload"] == "shared" else "2")
        cached, prompt = (int(x.replace(",", "")) for x in r["cached / prompt tokens"].split(" / "))
        # Cold servers: the shared workload's prefix is computed once, then read from the cache.
        assert (cached > 0) == (r["workload"] == "shared") and prompt > 0
        if r["server"] == "radixserve":
            assert float(r["vs llama.cpp"].rstrip("x")) == pytest.approx(
                float(r["req/s"]) / peer_rps(table, r), rel=0.05
            )
    started = (tmp_path / "llama-server.log").read_text().splitlines()
    assert len(started) == 2  # one cold start per cell
    assert all(line.startswith(f"-m {path} -t 1 -tb 1 -c 65536 -np 16 -kvu --port ") for line in started), started


def peer_rps(table: list[dict[str, str]], ours: dict[str, str]) -> float:
    (peer,) = (
        r for r in table if r["server"] == "llama.cpp" and (r["workload"], r["c"]) == (ours["workload"], ours["c"])
    )
    return float(peer["req/s"])


def test_without_llama_server_radixserve_rows_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    main(["--model-path", str(gguf_path("llama3")), "--workloads", "shared", *SMALL])
    printed = capsys.readouterr().out
    assert "no llama-server" in printed
    (row,) = rows(printed)
    assert (row["server"], row["vs llama.cpp"], row["done"]) == ("radixserve", "-", "4/4")
