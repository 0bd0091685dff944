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

The K-quant fixtures (manifest ``quantized``) need llama.cpp's ``llama-quantize``, built from the same
source distribution (docs/benchmarks/index.md, "Quantization formats side by side"): pass
``--llama-quantize PATH`` (or set ``LLAMA_QUANTIZE``). A tiny llama whose every linear has K a multiple
of 256 (llama-quantize stores rows of other lengths in a fallback type: Q5_0 for Q4_K, Q8_0 for Q6_K) is
converted to f16, then requantized, as users' files are made: ``llama-quantize F16 OUT TYPE 1``.
Without it the committed K-quant fixtures and their manifest entries are kept as they are;
``--quantized-only`` re-makes just those (the f16 fixtures and their entries untouched)::

    PYTHONPATH=$PWD /tmp/gguf-venv/bin/python -m tests.support.make_gguf_fixtures --quantized-only \
        --llama-cpp DIR --llama-quantize /path/to/build/bin/llama-quantize
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks.quant_formats import file_tensors
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
# The K-quant fixtures: fixture KQUANT_BASE at a size whose every K (hidden, intermediate) is a multiple of 256,
# one layer (llama-quantize's _M mixes then give that layer's attn_v and ffn_down Q6_K, the rest Q4_K / Q5_K;
# the tied token_embd, the output, Q6_K), each requantized file under 1 MB.
KQUANT_BASE = "llama3"
KQUANT_SHAPE: dict[str, int] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
KQUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")  # Q4_K, Q5_K and Q6_K each appear in some file
KQUANT_PREFIX = "llama-k256"


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


def make_quantized(llama_cpp: Path, llama_quantize: Path, work: Path, pre: str) -> dict[str, dict[str, object]]:
    """The K-quant fixtures: KQUANT_BASE at KQUANT_SHAPE (seed 0) converted to f16, then llama-quantize'd."""
    folder = build_arch_folder(KQUANT_BASE, work / "tiny-k256", **KQUANT_SHAPE)
    f16 = work / f"{KQUANT_PREFIX}-f16.gguf"
    convert(llama_cpp, folder, f16, pre)
    fixtures: dict[str, dict[str, object]] = {}
    for qtype in KQUANT_TYPES:
        name = f"{KQUANT_PREFIX}-{qtype.lower()}"
        out = gguf_path(name)
        subprocess.run([str(llama_quantize), str(f16), str(out), qtype, "1"], check=True, capture_output=True)
        fixtures[name] = {
            "file": out.name,
            "bytes": out.stat().st_size,
            "sha256": sha256(out),
            "base": KQUANT_BASE,
            "shape": KQUANT_SHAPE,
            "seed": 0,
            "made": f"base at shape, {OUTTYPE} by the converter, then `llama-quantize {f16.name} {out.name} {qtype} 1`",
            "tensor_types": file_tensors(out).types,
        }
    return fixtures


def make_ggufs(llama_cpp: Path, work: Path, pre: str) -> dict[str, object]:
    """Every spec's HF folder (seed 0) converted; returns the manifest."""
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


def make_manifest(args: argparse.Namespace, work: Path) -> dict[str, object]:
    """The fixtures the flags ask for, made; the rest of the manifest kept from the committed one."""
    manifest_path = GGUF_DIR / "manifest.json"
    manifest: dict[str, object] = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if args.tokenizers:
        make_tokenizers(work / "smollm2-full")
    llama_cpp = (args.llama_cpp or fetch_converter(work / "download")).resolve()
    pre = smollm_pre_check(llama_cpp, work / "smollm2-full")
    if not args.quantized_only:
        manifest = make_ggufs(llama_cpp, work, pre) | {k: v for k, v in manifest.items() if k.startswith("quantize")}
    if args.llama_quantize:
        manifest["quantizer"] = f"{CONVERTER} vendor/llama.cpp tools/quantize (llama-quantize), built from source"
        manifest["quantized"] = make_quantized(llama_cpp, args.llama_quantize.resolve(), work, pre)
    elif args.quantized_only:
        raise SystemExit("--quantized-only needs --llama-quantize PATH (or LLAMA_QUANTIZE)")
    else:
        print("no llama-quantize: the K-quant fixtures and their manifest entries are kept as committed")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, help="an unpacked vendor/llama.cpp (default: download it)")
    parser.add_argument("--tokenizers", action="store_true", help="re-make the committed tokenizers first")
    quantize = os.environ.get("LLAMA_QUANTIZE")
    parser.add_argument(
        "--llama-quantize",
        type=Path,
        default=Path(quantize) if quantize else None,
        help="llama.cpp's llama-quantize binary, for the K-quant fixtures (default: $LLAMA_QUANTIZE)",
    )
    parser.add_argument("--quantized-only", action="store_true", help="re-make only the K-quant fixtures")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gguf-fixtures-") as tmp:
        manifest = make_manifest(args, Path(tmp))
    (GGUF_DIR / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    made = {**manifest["fixtures"], **manifest.get("quantized", {})}  # type: ignore[dict-item]
    for name, entry in made.items():
        print(f"{name:18} {entry['bytes']:>9} bytes  {entry['sha256'][:12]}")


if __name__ == "__main__":
    main()
