"""Tiny random-weight models of every architecture radixserve serves, built with transformers' own classes.

``build_arch_folder("gemma2", folder)`` writes an HF folder (config.json, model.safetensors, the
tokenizer files): seeded, so the same name and seed give the same weights. Each ``ArchSpec`` names
the transformers class, the few settings that make the family what it is (rope scaling, biases,
q/k norms, sliding window, soft-capping, local/global layers), and the tokenizer it ships with
(committed under tests/fixtures/tokenizers/, made by make_gguf_fixtures.py):

- ``bpe-smollm``: SmolLM2's byte-level BPE cut to its first 1024 tokens (llama.cpp pre-tokenizer "smollm");
- ``spm-llama``: a SentencePiece BPE model in Llama 2 / Mistral v0.1 / Phi-3 style (<unk> <s> </s>, dummy prefix);
- ``spm-gemma``: a SentencePiece BPE model in Gemma style (<pad> <eos> <bos> <unk>, no dummy prefix).

The weights are float16-exact (rounded after HF's init and the norm/bias perturbation), so the
f16 GGUF that llama.cpp's converter makes from a folder holds the very values the float32 folder does;
norm weights are multiples of 2**-12, so Gemma's stored ``1 + w`` is exact in float32 too.
tests/fixtures/gguf/ holds those GGUFs (see make_gguf_fixtures.py and fidelity.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.support.tiny_model import TINY, perturb_norms_and_biases

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"
TOKENIZERS_DIR = FIXTURES_DIR / "tokenizers"
GGUF_DIR = FIXTURES_DIR / "gguf"

# tiny_model.TINY's shape, the vocabulary set per fixture tokenizer, 512 positions.
SMALL: dict[str, Any] = {**{k: v for k, v in TINY.items() if k != "vocab_size"}, "max_position_embeddings": 512}
# vocab size and special ids of each committed tokenizer (the model's vocab is exactly the tokenizer's)
TOKENIZER_IDS: dict[str, dict[str, int]] = {
    "bpe-smollm": dict(vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "spm-llama": dict(vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "spm-gemma": dict(vocab_size=1024, bos_token_id=2, eos_token_id=1, pad_token_id=0),
}
WINDOW = 8  # sliding window of mistral / gemma2 / gemma3: the tests' prompts are longer
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # small, so that with head_dim 16 some frequencies are kept, one is smoothed and the rest scaled
    original_max_position_embeddings=64,
)


@dataclass(frozen=True)
class ArchSpec:
    """One tiny fixture: what transformers builds, and what llama.cpp's converter makes of it."""

    name: str  # fixture name: tests/fixtures/gguf/<name>.gguf
    architecture: str  # radixserve's ModelConfig.architecture
    config_class: str  # transformers config class
    tokenizer: str  # folder under tests/fixtures/tokenizers
    gguf_arch: str  # the GGUF's general.architecture (llama.cpp converts Mistral as "llama")
    # "gguf": transformers' own GGUF loading reads the file faithfully; "gguf+config": its tensors are
    # right but its config mapping misses a setting the file or llama.cpp implies (see ``note``),
    # so the reference takes the tensors from the GGUF and the config from this spec.
    gguf_reference: str
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    # settings the converter does not carry into the GGUF: the GGUF is the HF model with these overrides
    gguf_overrides: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec(
            "llama3",
            "llama",
            "LlamaConfig",
            "bpe-smollm",
            "llama",
            "gguf+config",
            dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
            "Llama 3.2 style (tied). The converter stores llama3 rope scaling as the rope_freqs.weight "
            "tensor; transformers' GGUF loading drops it and runs plain rope.",
        ),
        ArchSpec(
            "llama3-untied",
            "llama",
            "LlamaConfig",
            "bpe-smollm",
            "llama",
            "gguf+config",
            dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE, attention_bias=True),
            "Llama 3.1 style (untied lm_head), with q/k/v/o biases (attention_bias): the converter permutes "
            "the q/k biases as it does the weights. Same rope_freqs note as llama3.",
        ),
        ArchSpec(
            "qwen2",
            "qwen2",
            "Qwen2Config",
            "bpe-smollm",
            "qwen2",
            "gguf",
            dict(tie_word_embeddings=False, use_sliding_window=False, rope_parameters={"rope_theta": 1000000.0}),
            "q/k/v biases; untied.",
        ),
        ArchSpec(
            "qwen3",
            "qwen3",
            "Qwen3Config",
            "bpe-smollm",
            "qwen3",
            "gguf+config",
            dict(tie_word_embeddings=True, use_sliding_window=False, rope_parameters={"rope_theta": 1000000.0}),
            "per-head q/k RMSNorm; tied. transformers' GGUF config mapping reads no head_dim for qwen3 "
            "(Qwen3Config's default 128; the file says 16 in attention.key_length).",
        ),
        ArchSpec(
            "mistral",
            "mistral",
            "MistralConfig",
            "spm-llama",
            "llama",
            "gguf",
            dict(tie_word_embeddings=False, sliding_window=WINDOW),
            "The HF folder has sliding_window 8; llama.cpp converts MistralForCausalLM as general.architecture "
            "'llama' and writes no sliding window, so the GGUF is a full-attention Llama (as real Mistral GGUFs are).",
            gguf_overrides=dict(sliding_window=None),
        ),
        ArchSpec(
            "phi3",
            "phi3",
            "Phi3Config",
            "spm-llama",
            "phi3",
            "gguf+config",
            dict(tie_word_embeddings=False, sliding_window=WINDOW),
            "fused qkv_proj and gate_up_proj (attn_qkv / ffn_up in the GGUF); a sliding window (Phi-3 mini's is "
            "2047), which the GGUF stores but transformers' GGUF config mapping does not read.",
        ),
        ArchSpec(
            "gemma2",
            "gemma2",
            "Gemma2Config",
            "spm-gemma",
            "gemma2",
            "gguf+config",
            dict(
                sliding_window=WINDOW,
                query_pre_attn_scalar=16,  # = head_dim: llama.cpp's rule for all but the 27B (GGUF stores none)
                attn_logit_softcapping=2.0,  # small, so that capping changes the logits of tiny random weights
                final_logit_softcapping=3.0,
            ),
            "layers alternate sliding (even) / global (odd) as llama.cpp assumes for gemma2. transformers' GGUF "
            "config mapping reads neither soft-capping value (defaults 50/30) nor a query_pre_attn_scalar "
            "(default 256).",
        ),
        ArchSpec(
            "gemma3",
            "gemma3",
            "Gemma3TextConfig",
            "spm-gemma",
            "gemma3",
            "gguf+config",
            dict(
                num_hidden_layers=6,  # llama.cpp's fixed gemma3 pattern: 5 sliding layers, then 1 global
                sliding_window=WINDOW,
                query_pre_attn_scalar=16,
                rope_parameters={  # linear scaling on the global layers, as Gemma 3 4B-27B (factor 8)
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            ),
            "Gemma3ForCausalLM; the GGUF stores rope.freq_base_swa and the global layers' linear rope scaling, "
            "transformers' GGUF config mapping reads no query_pre_attn_scalar (default 256).",
        ),
    )
}


def hf_config(name: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The transformers config of fixture ``name`` (``overrides`` replace any setting)."""
    spec = SPECS[name]
    kwargs = {**SMALL, **TOKENIZER_IDS[spec.tokenizer], **spec.config, **overrides}
    config: transformers.PretrainedConfig = getattr(transformers, spec.config_class)(**kwargs)
    return config


def build_arch_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Fixture ``name``'s random float32 model (eval mode), float16-exact weights (see the module doc)."""
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        hf_config(name, **overrides), dtype=torch.float32
    )
    model.eval()  # type: ignore[no-untyped-call]
    perturb_norms_and_biases(model)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(torch.round(param * 4096) / 4096)
            param.copy_(param.to(torch.float16).to(torch.float32))
    return model


def build_arch_folder(name: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Fixture ``name`` as an HF folder: config.json, model.safetensors and its tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    build_arch_model(name, seed, **overrides).save_pretrained(folder)
    for path in sorted((TOKENIZERS_DIR / SPECS[name].tokenizer).iterdir()):
        shutil.copy(path, folder / path.name)
    return folder


def gguf_path(name: str) -> Path:
    """The committed GGUF of fixture ``name`` (made by make_gguf_fixtures.py)."""
    return GGUF_DIR / f"{name}.gguf"
