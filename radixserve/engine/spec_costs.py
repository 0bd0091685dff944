"""What a verify forward costs on this machine, measured where the engine starts (speculative decoding).

The drafter (``scheduler/draft.py``) drafts as many tokens as pay: expected accepted tokens against what their
rows cost. That cost is the machine's and the model's: a CPU's rows are bound by multiplies (SmolLM2 at 1 thread:
a row ~0.2 of a decode step with AVX512-BF16, ~0.25 in float32 on an AVX2 Zen 3, with jumps where a kernel opens a
new tile of rows), a GPU's step by reading the weights (a row nearly free). So the engine times the forward the
scheduler runs for one request verifying k drafts (its newest token and its drafts as one-token decode rows) at
a few k (``timed_rows``: the first drafts, the most drafts and one more row, where a kernel's tile of 8 rows ends,
and twice that for batches; linear between them), on a context of zeroed slots; the best of 5 repeats, on the
thread's CPU clock where the forward runs on this thread alone (on 2 busy cores every row count 1 .. 9 at 3 repeats
each gave tables up to 30% apart from run to run: fewer row counts, more repeats). About 65 decode steps
(SmolLM2 at 1 thread on a Zen 3: ~1.1 s at start); the slots go back to the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from radixserve.memory.allocator import TokenAllocator
from radixserve.model.runner import ModelRunner, StepInput
from radixserve.scheduler.draft import VerifyCosts

logger = logging.getLogger(__name__)

CONTEXT = 256  # tokens of context each timed row reads (a chat turn's; attention is a small part at this length)
REPEATS = 5  # timings of each row count: the best is kept


def measure_verify_costs(
    runner: ModelRunner, allocator: TokenAllocator, max_drafts: int, context: int = CONTEXT, repeats: int = REPEATS
) -> VerifyCosts | None:
    """The costs of forwards of ``timed_rows(max_drafts)`` rows, measured; None where the pool has no room for them
    (the modelled costs stand)."""
    rows = timed_rows(max_drafts)
    context = min(context, max(allocator.free_size() - 2 * allocator.page_size - rows[-1], 0))
    slots = allocator.alloc(context + rows[-1]) if context >= 16 else None
    if slots is None:
        return None
    try:
        vocab = runner.config.vocab_size
        ids = np.random.default_rng(0).integers(0, vocab, rows[-1])
        clock = _clock(runner.device)
        forward = {n: _verify_forward(runner, ids, slots, context, n) for n in rows}
        forward[rows[-2]]()  # warm: the kernels' first call allocates
        best = dict.fromkeys(rows, float("inf"))
        for _ in range(repeats):  # row counts in turn, so a burst of load spreads over all of them
            for n in rows:
                best[n] = min(best[n], clock(forward[n]))
    finally:
        allocator.free(slots)
    return VerifyCosts([(n, best[n]) for n in rows], source="measured")


def timed_rows(max_drafts: int) -> list[int]:
    """The row counts timed: a decode, 1 and 3 drafts, 7 and 8 (a tile of 8 rows full, then one more: where the
    AVX512 K-quant kernel decodes every weight again), the most drafts and one more row, and twice that."""
    most = max_drafts + 1
    return sorted({1, 2, 4, min(8, most), min(9, most), most, 2 * most})


def _verify_forward(
    runner: ModelRunner, ids: np.ndarray, slots: np.ndarray, context: int, rows: int
) -> Callable[[], object]:
    """The forward of one request at ``context`` tokens verifying ``rows - 1`` drafts (a plain decode for 1)."""
    if rows == 1:
        step = [StepInput(ids[:1], slots[: context + 1])]
        return lambda: runner.forward(step, "decode")
    group = [StepInput(ids[:rows], slots[: context + rows], num_draft_tokens=rows - 1)]
    return lambda: runner.forward(group, "mixed", logit_rows=[rows])


def _clock(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds ``fn`` takes: on a CPU run by this thread alone its CPU time (other processes' load does not count),
    else wall time (with the GPU's queue drained)."""
    if device.type == "cuda":

        def timed(fn: Callable[[], object]) -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            return time.perf_counter() - start

        return timed
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def timed_cpu(fn: Callable[[], object]) -> float:
        start = now()
        fn()
        return now() - start

    return timed_cpu
