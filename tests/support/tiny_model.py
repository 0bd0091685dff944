"""Tiny random-weight Llama-family models saved as HF folders: for tests and quick benchmarks.

Weights are HF's own init with the norms and biases perturbed, so a swapped
norm or a dropped bias shows in the logits (HF inits them to ones and zeros).
The word-level tokenizer maps "w3 w7" to [3, 7], so prompts are easy to write.

The tests build them (through tests/conftest.py and tests/model/tiny.py), and so do
``four-way --tiny``, ``scale-out``, ``schedule``, ``soak`` and ``programs --tiny`` at run time
(see tests/support/__init__.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedModel, Qwen2Config

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)
CONFIG_CLASSES: dict[str, Any] = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "mistral": {"sliding_window": None},
}


def build_hf_model(arch: str, folder: Path, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random tiny ``arch`` model, float32, eval mode, saved as safetensors into ``folder``."""
    kwargs = {**TINY, **ARCH_DEFAULTS[arch], "tie_word_embeddings": False, **overrides}
    hf_config = CONFIG_CLASSES[arch](**kwargs)
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.eval()  # type: ignore[no-untyped-call]
    perturb_norms_and_biases(model)
    model.save_pretrained(folder)
    return model


def perturb_norms_and_biases(model: PreTrainedModel) -> None:
    """Norm weights + N(0, 0.1), biases ~ N(0, 0.1), in place (HF inits them to ones/zeros, which hides bugs)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)


VOCAB, EOS = int(TINY["vocab_size"]), 2


def save_word_tokenizer(folder: Path) -> None:
    """A whitespace word-level tokenizer over the tiny vocabulary: "w3 w7" -> [3, 7]."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = "{% for m in messages %}w{{ 3 + loop.index }} {{ m['content'] }} {% endfor %}w99"
    tok.save_pretrained(folder)


BYTE_VOCAB, BYTE_EOS = 260, 257  # 256 byte tokens, then <s>, </s>, <|im_start|>, <|im_end|>


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (one token per byte, no merges): any text encodes, so a grammar can spell anything.

    Its ids 0..255 are bytes in GPT-2's printable mapping; the chat template is ChatML.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_byte_chars())}
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab.update({name: 256 + i for i, name in enumerate(specials)})
    raw = RawTokenizer(models.BPE(vocab, [], ignore_merges=True))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", additional_special_tokens=specials[2:]
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.save_pretrained(folder)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character mapping (what byte-level BPE writes), indexed by byte value."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_byte_engine_folder(folder: Path, **overrides: Any) -> Path:
    """A tiny Llama over a byte-level tokenizer (``BYTE_VOCAB`` ids): for grammars and SGLang programs."""
    build_hf_model("llama", folder, seed=0, vocab_size=BYTE_VOCAB, eos_token_id=BYTE_EOS, bos_token_id=256, **overrides)
    save_byte_tokenizer(folder)
    return folder


def build_engine_folder(folder: Path, **overrides: Any) -> Path:
    """A tiny Llama with a word-level tokenizer: everything ``Engine.create(model_path=...)`` needs."""
    build_hf_model("llama", folder, seed=0, eos_token_id=EOS, bos_token_id=1, **overrides)
    save_word_tokenizer(folder)
    return folder
