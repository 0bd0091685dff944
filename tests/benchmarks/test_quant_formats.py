"""``radixserve bench quant-formats`` on the tiny fixtures: the table's bookkeeping, not its speed.

No llama.cpp here: without llama-bench its columns say "-"; a stand-in llama-bench (a script printing
llama-bench's JSON) checks the command the benchmark runs and the ratios it prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest

from benchmarks.quant_formats import file_tensors, main
from tests.support.archs import gguf_path

FAKE_PP, FAKE_TG, FAKE_TG_CTX = 1000.0, 50.0, 40.0  # the stand-in's tok/s
FAKE_LLAMA_BENCH = f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
assert args[args.index("-o") + 1] == "json" and args[args.index("-n") + 1] == "64", args
print(f"llama-bench {{' '.join(args)}}", file=open(sys.argv[0] + ".log", "a"))
prompt = int(args[args.index("-p") + 1])
depth = int(args[args.index("-d") + 1].split(",")[1])
records = [
    {{"n_prompt": prompt, "n_gen": 0, "n_depth": 0, "avg_ts": {FAKE_PP}}},
    {{"n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ts": {FAKE_TG}}},
    {{"n_prompt": prompt, "n_gen": 0, "n_depth": depth, "avg_ts": 1.0}},
    {{"n_prompt": 0, "n_gen": 64, "n_depth": depth, "avg_ts": {FAKE_TG_CTX}}},
]
print(json.dumps(records))
"""
FLAGS = ["--context", "32", "--decode-steps", "2", "--rounds", "1"]


def table(printed: str) -> list[list[str]]:
    """The printed table's rows, split into their columns (two or more spaces apart)."""
    lines = printed[printed.index("file ") :].splitlines()
    return [[cell.strip() for cell in line.split("  ") if cell.strip()] for line in lines]


def test_without_llama_bench_one_row_per_file_and_the_file_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    paths = [gguf_path("llama3"), gguf_path("qwen2")]
    main(["--model-path", ",".join(map(str, paths)), *FLAGS])
    printed = capsys.readouterr().out
    assert "note: no llama-bench" in printed
    header, *rows = table(printed)
    assert [r[0] for r in rows] == ["llama3.gguf 1t", "qwen2.gguf 1t"]
    for path, cells in zip(paths, rows):
        values = dict(zip(header, cells))
        assert (values["llama pp / tg / tg@ctx"], values["prefill / pp"], values["b1 / tg"]) == ("- / - / -", "-", "-")
        assert values["b1 / tg@ctx"] == "-"
        stored = file_tensors(path)
        reader = gguf.GGUFReader(path)
        assert stored.tensor_bytes == sum(t.data.nbytes for t in reader.tensors) < path.stat().st_size
        # f16 matrices, f32 norms: the float copy radixserve holds is at least the file's tensor bytes
        assert values["types"] == " ".join(f"{k}:{v}" for k, v in stored.types.items())
        weights_mib, file_mib = (float(x) for x in values["weights / file MiB"].split(" / "))
        assert file_mib == round(stored.tensor_bytes / 2**20, 1) and weights_mib >= file_mib


def test_a_stand_in_llama_bench_gives_the_ratios(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    path = gguf_path("llama3")
    main(["--model-path", str(path), "--llama-bench", str(fake), *FLAGS])
    header, row = table(capsys.readouterr().out)
    values = dict(zip(header, row))
    assert values["llama pp / tg / tg@ctx"] == f"{FAKE_PP:.0f} / {FAKE_TG:.0f} / {FAKE_TG_CTX:.0f}"
    prefill, decode_1, _ = (float(x) for x in values["rs prefill / b1 / b16"].split(" / "))
    assert float(values["prefill / pp"].rstrip("x")) == pytest.approx(prefill / FAKE_PP, abs=0.01)
    assert float(values["b1 / tg"].rstrip("x")) == pytest.approx(decode_1 / FAKE_TG, abs=0.01)
    assert float(values["b1 / tg@ctx"].rstrip("x")) == pytest.approx(decode_1 / FAKE_TG_CTX, abs=0.01)
    ran = (tmp_path / "llama-bench.log").read_text().splitlines()
    assert ran == [f"llama-bench -m {path} -t 1 -p 32 -n 64 -d 0,32 -o json"]
