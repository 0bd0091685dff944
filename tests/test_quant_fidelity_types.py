"""Each GGUF type people download, end to end: SmolLM2 requantized per type against its float32 model.

The embedded file's weights dequantized to float32 are the reference (``--quantization none --dtype
float32``). Each type's file is made from those float32 weights as ``llama-quantize --allow-requantize``
makes it (tests/support/gguf_rewrite.py's ``requantize_gguf``: gguf-py for Q4_0 / Q5_0 / Q5_1 / Q8_0,
tests/support/kquants.py for the K-quants, llama.cpp's per-tensor mix for Q4_K_M / Q5_K_M / Q6_K) and loaded
with ``--quantization auto --dtype float32``; next-token top-1 agreement and mean KL are measured over
every position of a fixed prompt. The files are cached across runs under the system's temp folder, keyed by
the source's bytes, the quantizers' code and gguf's version. Measured (1 thread, load ~7 on 2 cores): cold,
the file takes ~65 s of CPU (~2.5 min of wall); warm ~24 s of CPU (~50 s of wall).
Each file's tensors equal, type and bytes, those llama-quantize (llama.cpp as vendored by llama-cpp-python
0.3.36, ``--allow-requantize``) writes from the same source.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from radixserve.model.gguf_loader import default_model_path
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import load_model
from tests.model.test_precision import agreement_and_kl, all_logits
from tests.support import gguf_rewrite, kquants
from tests.test_smollm2 import CHATS

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROSE = (
    "The river starts high in the mountains, where snow melts every spring. It runs past small villages and "
    "old stone bridges, then widens as it reaches the plain. Farmers use its water for their fields, and in "
    "summer children swim near the banks. By the time it meets the sea, it has travelled more than three "
    "hundred kilometres."
)
# type -> (min top-1, max mean KL) over the prompt's 256 positions. Measured (float32, Xeon, main at 8d2de54,
# where auto keeps Q8_0 / Q4_0 as blocks and dequantizes the rest to float): Q8_0 0.977 / 1.60e-3, Q6_K
# 0.973 / 5.26e-3, Q5_K_M 0.910 / 8.90e-2, Q4_K_M 0.883 / 1.02e-1, Q5_0 0.867 / 1.18e-1, Q5_1 0.867 /
# 1.31e-1, Q4_0 0.793 / 3.25e-1. Pinned at top-1 - 0.03 (8 positions) and KL x 1.3 (+ 1e-3 for the two
# closest): kernels that keep these blocks must give the same values within float rounding, so the same
# numbers. (Q5_1 trails Q5_0 here: the source's Q4_1 levels fall between Q5_1's, a requantization artefact.)
# Left out of the requantized files (the test reads no tokenizer from them): parsing it doubles a load.
VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
THRESHOLDS = {
    "Q8_0": (0.95, 3e-3),
    "Q6_K": (0.94, 8e-3),
    "Q5_K_M": (0.88, 0.12),
    "Q4_K_M": (0.85, 0.135),
    "Q5_0": (0.835, 0.155),
    "Q5_1": (0.835, 0.17),
    "Q4_0": (0.76, 0.42),
}

# The same files with int8 activations (``--quantization q4_1``: every kept matrix but the float types' multiplies
# activations quantized to int8 blocks of 32, as llama.cpp does; csrc/block_q8_linear.cpp, gguf_rows_q8_linear.cpp).
# Measured (float32, Xeon, this branch), next to the float activations' above: Q8_0 0.969 / 5.28e-3, Q6_K 0.961 /
# 9.20e-3, Q5_K_M 0.906 / 9.29e-2, Q4_K_M 0.883 / 1.06e-1, Q5_0 0.855 / 1.23e-1, Q5_1 0.871 / 1.32e-1, Q4_0 0.789 /
# 3.20e-1: int8 activations cost the 8-bit types (Q8_0, Q6_K) most, 3x the KL; the 4-5 bit ones within 5%. Pinned
# by the same rule.
INT8_THRESHOLDS = {
    "Q8_0": (0.94, 8e-3),
    "Q6_K": (0.93, 0.013),
    "Q5_K_M": (0.875, 0.121),
    "Q4_K_M": (0.85, 0.138),
    "Q5_0": (0.825, 0.16),
    "Q5_1": (0.84, 0.172),
    "Q4_0": (0.755, 0.42),
}


@pytest.fixture(scope="module")
def cache() -> Path:
    """The folder of the requantized files: keyed by the source's bytes, the quantizers' code, gguf's version."""
    key = hashlib.sha256(Path(default_model_path()).read_bytes())
    key.update(f"{importlib.metadata.version('gguf')} {' '.join(VOCABULARY)}".encode())
    for module in (gguf_rewrite, kquants):
        key.update(Path(str(module.__file__)).read_bytes())
    folder = Path(tempfile.gettempdir()) / f"radixserve-requantized-{key.hexdigest()[:16]}"
    if not folder.exists():  # new code or source: sets of other keys (~750 MB each) a day old are stale
        for stale in folder.parent.glob("radixserve-requantized-*"):
            if time.time() - stale.stat().st_mtime > 86_400:
                shutil.rmtree(stale, ignore_errors=True)
        folder.mkdir(exist_ok=True)
    return folder


def requantized(cache: Path, preset: str) -> Path:
    """SmolLM2 as ``llama-quantize --allow-requantize`` would store it as ``preset``: made once, then cached."""
    source = Path(default_model_path())
    path = cache / f"{source.stem}.{preset}.gguf"
    if not path.exists():
        partial = cache / f".{path.name}.{os.getpid()}"
        gguf_rewrite.requantize_gguf(source, partial, preset, drop=VOCABULARY)
        os.replace(partial, path)  # whole or absent, for a concurrent run
    return path


@pytest.fixture(scope="module")
def float32() -> tuple[list[int], torch.Tensor]:
    """The prompt (SmolLM2's chat template on each chat question in turn, then a paragraph) and its float32 logits."""
    loaded = load_model(None, CPU, torch.float32, quantization="none")
    assert loaded.tokenizer is not None
    chats = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}]) for question in CHATS]
    prompt = [token for chat in chats for token in chat] + loaded.tokenizer.encode(PROSE, add_special_tokens=False)
    return prompt, logits_of(loaded.model, prompt)


def logits_of(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """Logits of every position of ``prompt``, one cold prefill."""
    assert isinstance(model, LlamaForCausalLM)
    with torch.no_grad():
        return all_logits(model, [prompt])


@pytest.mark.parametrize(
    ("preset", "quantization"),
    [(preset, "auto") for preset in THRESHOLDS] + [(preset, "q4_1") for preset in INT8_THRESHOLDS],
)
def test_requantized_smollm2_stays_close_to_float32(
    preset: str,
    quantization: str,
    cache: Path,
    float32: tuple[list[int], torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt, reference = float32
    monkeypatch.setattr("radixserve.model.loader.Tokenizer.from_model_path", lambda path, gguf_reader=None: None)
    loaded = load_model(str(requantized(cache, preset)), CPU, torch.float32, quantization=quantization)
    top1, kl = agreement_and_kl(reference, logits_of(loaded.model, prompt))
    print(f"{preset} ({quantization}) vs float32 on SmolLM2 ({len(prompt)} positions): top-1 {top1:.3f}, KL {kl:.2e}")
    print(f"  {loaded.quantization_reason}")
    min_top1, max_kl = (THRESHOLDS if quantization == "auto" else INT8_THRESHOLDS)[preset]
    assert top1 >= min_top1 and kl <= max_kl
