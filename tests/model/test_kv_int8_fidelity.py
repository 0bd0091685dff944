"""The 8-bit KV pool against the bfloat16 one on the embedded SmolLM2, with ``bench kv-fidelity``'s own code:
a chat turn, code and a document of ~1,100 tokens, teacher-forced (prefilled in chunks: every position reads
the pool) and greedily continued. Thresholds sit below what was measured (noted next to each); the full table
(the 2,400-token document, 128 new tokens) is BENCHMARKS.md's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.kv_fidelity import build, measure, prompts
from radixserve.engine import Engine
from radixserve.model.attention import extend_kernel_usable

pytestmark = [
    pytest.mark.skipif(not extend_kernel_usable(), reason="measured with the bfloat16 extend kernel"),
    pytest.mark.slow,  # ~30 s: two SmolLM2 engines, ~1,400 teacher-forced positions and 6 x 32 greedy tokens
]
NEW_TOKENS = 32
# prompt: (min top-1, max mean KL, min first greedy divergence). Measured on the AMX Xeon (top-1, KL, divergence):
THRESHOLDS = {
    # 44 tokens: 0.955, 7.1e-3, none in 32; 9 since the paged values pass sums in position order (a near-tie:
    # bfloat16 against float32 parts at 9 too)
    "chat": (0.93, 0.012, 8),
    "code": (0.97, 0.005, 12),  # 168 tokens: 0.988, 2.4e-3, 27
    # 1,222 tokens: 0.967, 2.7e-3, none in 32; 12 since the decode kernel's value pass quantizes its weights (an
    # exact three-way tie there in the bfloat16 pool's own logits; top-1 and KL of 256 decode steps unchanged)
    "document": (0.95, 0.005, 10),
}


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    yield build(None, ["bfloat16", "int8"], 4096)


@pytest.mark.parametrize("name", list(THRESHOLDS))
def test_the_8bit_pool_stays_close_to_bfloat16(engines: list[Engine], name: str) -> None:
    ids = prompts(engines[0], document_chars=5000)[name]
    row = measure(engines, ids, 256, NEW_TOKENS)
    print(f"{name}: {row}")
    min_top1, max_kl, min_divergence = THRESHOLDS[name]
    assert row.top1 >= min_top1 and row.mean_kl <= max_kl and row.divergence >= min_divergence
