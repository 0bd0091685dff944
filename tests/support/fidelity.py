"""Reference logits and greedy tokens from transformers, for an HF folder or a GGUF file: what radixserve must match.

- An HF folder loads with ``AutoModelForCausalLM.from_pretrained`` (float32, eager attention: the
  implementation that honours soft-capping and sliding windows exactly).
- A GGUF's tensors come from transformers' own GGUF reading (``load_gguf_checkpoint``: dequantization,
  llama.cpp names, the q/k un-permutation, Gemma's ``w - 1``). Its config comes from transformers' GGUF
  metadata mapping (``AutoConfig.from_pretrained(dir, gguf_file=...)``) where that mapping is faithful,
  and from the fixture's spec where it is not: a committed fixture's ``ArchSpec.gguf_reference`` says
  which ("gguf" or "gguf+config", with the reason in its note). Measured on the committed fixtures:
  "gguf" is exact for qwen2 and mistral (read as the full-attention Llama the file is);
  llama3 (rope_freqs dropped), qwen3 (head_dim read as 128), phi3 (sliding window dropped), gemma2
  (soft-capping, query scale) and gemma3 (query scale) need "gguf+config", with which every fixture's
  logits equal its HF folder's exactly.

This is what ``from_pretrained(dir, gguf_file=...)`` does, minus its ``accelerate`` requirement (not a
project dependency): with accelerate installed the two give bit-identical logits on every fixture.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tests.support.archs import GGUF_DIR, SPECS, hf_config


def gguf_reference_config(path: Path) -> transformers.PretrainedConfig:
    """The config the reference runs a GGUF with: its fixture spec's for "gguf+config", else transformers' reading."""
    spec = SPECS.get(path.stem) if path.parent.resolve() == GGUF_DIR.resolve() else None
    if spec is not None and spec.gguf_reference == "gguf+config":
        return hf_config(spec.name)
    config: transformers.PretrainedConfig = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return config


def load_gguf_reference(path: Path, config: transformers.PretrainedConfig | None = None) -> PreTrainedModel:
    """A float32 transformers model holding the GGUF's tensors (see the module doc for ``config``)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = config or gguf_reference_config(path)
    config._attn_implementation = "eager"
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]  # type: ignore[no-untyped-call]
    state = {name: torch.as_tensor(value) for name, value in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{path.name}: missing {missing}, unexpected {unexpected} (transformers' GGUF reading)")
    model.tie_weights()
    model.eval()  # type: ignore[no-untyped-call]
    return model


@functools.cache
def reference_model(path: str) -> PreTrainedModel:
    """transformers' float32 model of an HF folder or a ``.gguf`` file (cached per path: treat it as read-only)."""
    if Path(path).is_dir():
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()  # type: ignore[no-untyped-call]
        return model
    return load_gguf_reference(Path(path))


def reference_logits(path: str | Path, ids: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of every position of one prompt, by transformers."""
    model: Any = reference_model(str(path))
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([list(ids)])).logits[0].float()
    return logits


def reference_greedy(path: str | Path, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: exactly ``max_new_tokens`` ids (no stop token)."""
    model: Any = reference_model(str(path))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


def fixture_prompt(length: int, vocab_size: int = 1024, seed: int = 1) -> list[int]:
    """Seeded random ids in [4, vocab_size): longer than the fixtures' sliding window (8) when length > 8."""
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(4, vocab_size, (length,), generator=generator)]
