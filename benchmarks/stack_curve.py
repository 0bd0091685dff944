"""The premise of thrash-resistant insertion, without a tree: does LRU thrash on a trace (``bench insertion``)?

Each request's blocks, named by their whole prefix, as one access stream. LRU's hit rate at C blocks is the share
of accesses whose stack distance (the distinct blocks read since the last read of this one) is at most C. A stable
subset of share s of the names, given the whole pool, gets s x LRU(C / s): what LIP / BIP reach when reuse
distances exceed the pool (Qureshi et al., ISCA '07). Thrashing is a convex LRU curve (a cliff), where some s < 1
wins; on a concave curve s = 1 (LRU itself) is best.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from benchmarks.workloads import TraceRequest

SUBSET_SHARES = (1.0, 0.75, 0.5, 0.33, 0.25, 0.125, 0.0625)


def block_names(requests: Sequence[TraceRequest], block_tokens: int) -> list[Hashable]:
    """Each prompt's blocks in order, a block named by its whole prefix (equal names: equal prefixes)."""
    names: list[Hashable] = []
    for request in requests:
        name: Hashable = request.extra_key
        for start in range(0, len(request.prompt), block_tokens):
            name = hash((name, request.prompt[start : start + block_tokens].tobytes()))
            names.append(name)
    return names


def stack_distances(names: Sequence[Hashable]) -> np.ndarray:
    """Per access: distinct names read since this name's last read (-1 at a first read). Fenwick tree, O(n log n)."""
    size = len(names)
    tree = [0] * (size + 1)

    def add(i: int, v: int) -> None:
        i += 1
        while i <= size:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # marks at positions <= i
        total, i = 0, i + 1
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[Hashable, int] = {}
    out = np.full(size, -1, dtype=np.int64)
    for t, name in enumerate(names):
        p = last.get(name)
        if p is not None:
            out[t] = prefix(t - 1) - prefix(p)  # one mark per distinct name, at its latest read
            add(p, -1)
        add(t, 1)
        last[name] = t
    return out


def stack_curve(requests: Sequence[TraceRequest], fractions: Sequence[float], block_tokens: int) -> list[str]:
    """LRU's block hit rate at each share of the distinct blocks, and the best stable subset's s x LRU(C / s)."""
    distances = stack_distances(block_names(requests, block_tokens))
    reused = np.sort(distances[distances >= 0])
    blocks = len(distances) - len(reused)  # distinct names

    def lru(capacity: float) -> float:
        return float(np.searchsorted(reused, capacity, side="right")) / len(distances)

    lines = [f"{len(distances):,} block reads, {blocks:,} distinct, {len(reused) / len(distances):.1%} rereads"]
    for fraction in fractions:
        capacity = fraction * blocks
        best, share = max((s * lru(capacity / s), s) for s in SUBSET_SHARES)
        quartiles = " ".join(f"{q:.2f}" for q in np.quantile(reused, [0.25, 0.5, 0.75]) / capacity)
        lines.append(
            f"{fraction:>6.1%}  lru {lru(capacity):6.2%}  best stable subset {best:6.2%} (s = {share:g})"
            f"  reuse distance / C quartiles {quartiles}"
        )
    return lines
