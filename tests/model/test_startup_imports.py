"""What start-up imports: building a model and a GGUF's tokenizer pulls in none of the heavy modules
only some paths need (measured: torch._dynamo + sympy 3-5 s, transformers' AutoTokenizer 1.3 s,
xgrammar 0.4 s). Checked in a fresh interpreter, where nothing has imported them yet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
