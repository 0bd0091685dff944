"""Make llamacpp_reference.json: what llama.cpp itself encodes the shared corpus to, under every
``tokenizer.ggml.pre`` we build (SmolLM2's vocabulary standing in) and for sentencepiece.gguf.

Not run by the tests (they read the committed file). Needs llama-cpp-python, built from its source
distribution in a throwaway venv (no dependency of the project); from the repository root:

    python -m venv /tmp/lcppvenv
    CMAKE_ARGS="-DGGML_NATIVE=OFF" /tmp/lcppvenv/bin/pip install llama-cpp-python==0.3.36  # builds llama.cpp
    PYTHONPATH=$PWD:/tmp/lcppvenv/lib/python3.11/site-packages python tests/model/data/make_llamacpp_reference.py

Every text is tokenized as llama.cpp's server tokenizes a prompt: special tokens parsed, no BOS.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import llama_cpp

from radixserve.model.gguf_tokenizer import PRE_TOKENIZER_SPLITS
from tests.model.test_tokenizer_gguf import CORPUS
from tests.model.test_tokenizer_llamacpp import write_smollm2_vocab_gguf

HERE = Path(__file__).resolve().parent


def encode_all(path: Path, texts: list[str]) -> list[list[int]]:
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [model.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in texts]


def main() -> None:
    reference: dict[str, object] = {"llama_cpp_python": llama_cpp.__version__, "texts": CORPUS}
    with tempfile.TemporaryDirectory() as folder:
        reference["smollm2_vocab"] = {
            pre: encode_all(write_smollm2_vocab_gguf(Path(folder) / f"{pre}.gguf", pre), CORPUS)
            for pre in sorted(PRE_TOKENIZER_SPLITS)
        }
    reference["sentencepiece"] = encode_all(HERE / "sentencepiece.gguf", CORPUS)
    (HERE / "llamacpp_reference.json").write_text(json.dumps(reference, ensure_ascii=False) + "\n")
    print(f"{len(PRE_TOKENIZER_SPLITS)} pre-tokenizers and sentencepiece.gguf, {len(CORPUS)} texts each")


if __name__ == "__main__":
    main()
