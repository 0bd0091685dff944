"""A mixed step (prefill chunks next to running decodes, one forward) against the same requests run apart.

The engine's ``--enable-mixed-chunk`` puts a prompt's next chunk and every
running decode in one ForwardBatch; each request must come out as it would
from its own extend or decode step, on both attention backends, with every
routing of the paged backend in play: decode rows and a short extend through
the kernel, a long extend through gather + SDPA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.model import paged_kernel
from radixserve.model.llama import LlamaForCausalLM
from tests.model.tiny import alloc, build_hf_model, load_ours, make_batch, make_pool

# float32, not bit-exact: the linears run over 26 rows here and over 23 and 2 apart, and the CPU
# matmul blocks by row count (last bits differ; the same holds between any two batch sizes today).
TOLERANCE = 1e-5  # measured: 1.2e-6 at most
BACKENDS = ["reference", pytest.param("paged", marks=pytest.mark.skipif(not paged_kernel.load(), reason="no kernel"))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixed")
    build_hf_model("llama", path)
    return path


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def setup(model: LlamaForCausalLM) -> tuple[object, list[tuple[list[int], torch.Tensor]]]:
    """A pool where two requests have prefilled (now decoding) and one has a cached 9-token prefix.

    Returns the pool and the next step's items: a 20-token chunk on the prefix, decode A,
    a cold 3-token extend, decode B (interleaved, as no step needs them sorted).
    """
    pool, allocator = make_pool(model.config)
    alloc(allocator, 7)  # slots out of order and apart, as after churn
    prompts = [ids(11, 1), ids(5, 2), ids(9, 3)]
    contexts = [alloc(allocator, len(p)).flip(0) for p in prompts]
    model(make_batch("extend", list(zip(prompts, contexts))), pool)
    decode_a = ([17], torch.cat([contexts[0], alloc(allocator, 1)]))
    decode_b = ([23], torch.cat([contexts[1], alloc(allocator, 1)]))
    chunk = (ids(20, 4), torch.cat([contexts[2], alloc(allocator, 20)]))
    short = (ids(3, 5), alloc(allocator, 3))
    return pool, [chunk, decode_a, short, decode_b]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_step_equals_separate_extend_and_decode_steps(folder: Path, backend: str) -> None:
    model = load_ours(folder)
    model.attention_backend = backend
    pool, items = setup(model)
    mixed = model(make_batch("mixed", items), pool)
    mixed_k = [k.clone() for k in pool.k]

    pool, items = setup(model)
    extend = model(make_batch("extend", [items[0], items[2]]), pool)
    decode = model(make_batch("decode", [items[1], items[3]]), pool)
    apart = torch.stack([extend[0], decode[0], extend[1], decode[1]])
    assert mixed.shape == (4, 128)
    torch.testing.assert_close(mixed, apart, rtol=0, atol=TOLERANCE)
    for layer, k in enumerate(mixed_k):  # the K/V every request wrote, too
        torch.testing.assert_close(k, pool.k[layer], rtol=0, atol=TOLERANCE)
