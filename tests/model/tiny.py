"""Tiny random HF models saved to disk, and small helpers to drive our model by hand.

Weights are HF's own init with the norms and biases perturbed, so a swapped
norm or a dropped bias shows in the logits (HF inits them to ones and zeros).
"""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool
from radixserve.model.config import ModelConfig
from radixserve.model.forward import ForwardBatch
from radixserve.model.gguf_loader import load_gguf
from radixserve.model.hf_loader import load_hf_folder
from radixserve.model.llama import LlamaForCausalLM
from tests.support.tiny_model import (  # noqa: F401  (re-exported for the tests)
    BYTE_EOS,
    BYTE_VOCAB,
    EOS,
    TINY,
    VOCAB,
    build_byte_engine_folder,
    build_engine_folder,
    build_hf_model,
    save_word_tokenizer,
)


def load_ours(path: Path, dtype: torch.dtype = torch.float32, backend: str = "auto") -> LlamaForCausalLM:
    """Our model of an HF folder or a ``.gguf`` file, as load_model builds it (tokenizer aside)."""
    config, weights = load_hf_folder(path) if path.is_dir() else load_gguf(path)
    model = LlamaForCausalLM(config, dtype=dtype, attention_backend=backend)
    model.load_weights(weights)
    return model.eval()


def make_pool(
    config: ModelConfig, size: int = 512, dtype: torch.dtype = torch.float32
) -> tuple[KVPool, TokenAllocator]:
    """A KV pool with ``size`` usable slots (row 0 is padding) and its allocator."""
    pool = KVPool(config.num_layers, size + 1, config.num_kv_heads, config.head_dim, dtype=dtype)
    return pool, TokenAllocator(size)


def make_batch(mode: str, items: list[tuple[list[int], torch.Tensor]]) -> ForwardBatch:
    """Per request (new token ids, whole-context slots, new tokens last) -> a ForwardBatch."""
    ids, positions, out_slots = [], [], []
    for new_ids, context in items:
        prefix_len = len(context) - len(new_ids)
        ids.append(torch.tensor(new_ids, dtype=torch.int64))
        positions.append(torch.arange(prefix_len, len(context)))
        out_slots.append(context[prefix_len:])
    return ForwardBatch(
        mode,  # type: ignore[arg-type]
        torch.cat(ids),
        torch.cat(positions),
        torch.cat(out_slots),
        [context for _, context in items],
        [len(new_ids) for new_ids, _ in items],
    )


def alloc(allocator: TokenAllocator, num_tokens: int) -> torch.Tensor:
    slots = allocator.alloc(num_tokens)
    assert slots is not None, "test pool too small"
    return torch.from_numpy(slots)
