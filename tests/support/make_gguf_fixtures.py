"""Make the committed fixtures: the tiny tokenizers, and one GGUF per tiny architecture, with llama.cpp's own converter.

Nothing here runs in CI or in the tests: they read what this wrote (tests/fixtures/). Re-run it after
changing tests/support/archs.py, in a throwaway venv that sees the project's torch and transformers
and has ``sentencepiece`` (the converter needs it, and so does training the SentencePiece tokenizers)::

    python3 -m venv /tmp/gguf-venv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/gguf-venv/lib/python3.11/site-packages/project.pth
    /tmp/gguf-venv/bin/pip install sentencepiece
    PYTHONPATH=$PWD /tmp/gguf-venv/bin/python -m tests.support.make_gguf_fixtures [--llama-cpp DIR]

Without ``--llama-cpp`` it downloads the llama-cpp-python source distribution (``pip download
--no-binary``; ~77 MB) into a temporary folder and uses its ``vendor/llama.cpp`` (``convert_hf_to_gguf.py``
+ ``gguf-py``). ``--tokenizers`` first re-makes the committed tokenizers (SmolLM2's cut from the embedded
GGUF; the two SentencePiece models trained on tests/fixtures/tokenizers/corpus.txt): byte for byte the
same unless the code, the corpus or a library changed. Writes tests/fixtures/gguf/<name>.gguf and
manifest.json (sizes, sha256, the converter, each fixture's reference route).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.support.archs import GGUF_DIR, SPECS, TOKENIZERS_DIR, build_arch_folder, gguf_path
from tests.support.fixture_tokenizers import make_tokenizers, smollm_pre_check

CONVERTER = "llama-cpp-python==0.3.36"
OUTTYPE = "f16"
# Runs the converter in-process so that, for the cut SmolLM2 vocabulary, the BPE pre-tokenizer name can
# be given: the converter recognises a pre-tokenizer by hashing the ids it gives a test string, and a cut
# vocabulary gives other ids. smollm_pre_check() first asks the converter about the full tokenizer.
RUNNER = """
import sys
llama_cpp, pre, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
import conversion.base
if pre != "-":
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *args]
convert_hf_to_gguf.main()
"""


def fetch_converter(dest: Path) -> Path:
    """llama.cpp's converter and gguf-py, from the llama-cpp-python source distribution on the package index."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", CONVERTER, "-d", str(dest)],
        check=True,
    )
    (archive,) = dest.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        wanted = [
            m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and "/vendor/llama.cpp/ggml" not in m.name
        ]
        tar.extractall(dest, members=wanted, filter="data")
    (llama_cpp,) = dest.glob("llama_cpp_python-*/vendor/llama.cpp")
    return llama_cpp


def convert(llama_cpp: Path, folder: Path, out: Path, pre: str) -> None:
    """``convert_hf_to_gguf.py folder --outfile out --outtype f16``; ``pre`` names the BPE pre-tokenizer, or '-'."""
    args = [str(folder), "--outfile", str(out), "--outtype", OUTTYPE]
    subprocess.run([sys.executable, "-c", RUNNER, str(llama_cpp), pre, *args], check=True, cwd=llama_cpp)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_ggufs(llama_cpp: Path, work: Path) -> dict[str, object]:
    """Every spec's HF folder (seed 0) converted; returns the manifest."""
    pre = smollm_pre_check(llama_cpp, work / "smollm2-full")
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    fixtures = {}
    for name, spec in SPECS.items():
        folder = build_arch_folder(name, work / f"tiny-{name}")
        out = gguf_path(name)
        convert(llama_cpp, folder, out, pre if spec.tokenizer.startswith("bpe") else "-")
        fixtures[name] = {
            "file": out.name,
            "bytes": out.stat().st_size,
            "sha256": sha256(out),
            "general.architecture": spec.gguf_arch,
            "hf_class": spec.config_class.replace("Config", "").replace("Text", "") + "ForCausalLM",
            "tokenizer": spec.tokenizer,
            "seed": 0,
            "reference": spec.gguf_reference,
            "note": spec.note,
        }
    return {
        "converter": f"{CONVERTER} vendor/llama.cpp/convert_hf_to_gguf.py --outtype {OUTTYPE}",
        "made_by": "tests/support/make_gguf_fixtures.py",
        "tokenizers": {
            p.relative_to(TOKENIZERS_DIR).as_posix(): sha256(p) for p in sorted(TOKENIZERS_DIR.rglob("*.*"))
        },
        "fixtures": fixtures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, help="an unpacked vendor/llama.cpp (default: download it)")
    parser.add_argument("--tokenizers", action="store_true", help="re-make the committed tokenizers first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gguf-fixtures-") as tmp:
        work = Path(tmp)
        if args.tokenizers:
            make_tokenizers(work / "smollm2-full")
        llama_cpp = args.llama_cpp or fetch_converter(work / "download")
        manifest = make_ggufs(llama_cpp.resolve(), work)
    (GGUF_DIR / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name, entry in manifest["fixtures"].items():  # type: ignore[attr-defined]
        print(f"{name:14} {entry['bytes']:>9} bytes  {entry['sha256'][:12]}")


if __name__ == "__main__":
    main()
