"""The ``minisim`` candidate set: the tree evicts by whichever fixed policy its miniature simulations rank best.

Every fixed policy in ``ranks`` (LRU, LFU, SLRU) runs as a shadow cache (minisim.py) over a spatial sample of
the blocks the tree is asked for, at ``rate`` x the tree's capacity: a lookup (``note_lookup``) counts in each
shadow the sampled blocks it holds, a finished request's insert (``note_finished``) adds its blocks or counts a
reuse. Scores are the hit tokens, scaled by ``DECAY`` every ``EPOCH_BLOCKS`` sampled blocks looked up (a window
of recent traffic: a workload that changes character changes the choice). The live candidates are one
``CandidateHeap`` ranked by the current choice; at an epoch's end, when another shadow leads it by more than
``MARGIN`` of the window's sampled lookup tokens (hysteresis: noise does not flip it), the heap is rebuilt under
the leader's rank (O(n), at most once an epoch). It starts on ``INITIAL`` (LFU).

The rate is ``RATE`` unless the shadows would then hold fewer than ``MIN_SHADOW_BLOCKS`` blocks: small pools
sample more (up to every block), so a shadow is not too small to rank policies as its full-size cache would.

Deterministic given the trace (the sample is a hash of the tokens, not a random draw; no clock read), bounded
(each shadow at most ``rate`` x the pool's tokens / ``BLOCK_TOKENS`` blocks, ``MIN_SHADOW_BLOCKS`` at least,
O(1) per block), and in LRU's cost class: the live heap is LRU's (or LFU's, SLRU's) and the tree's calls go to
it directly; a request adds one vectorised hash of its key at lookup and one at insert, and O(1) work per
sampled block per shadow.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

from radixserve.cache.core.candidates import CandidateHeap, Rank
from radixserve.cache.core.key import RadixKey
from radixserve.cache.learned.minisim import SHADOWS, BlockSampler


class DuelingCandidates:
    """Unlocked leaves for the ``minisim`` policy: ``CandidateHeap``'s interface plus the shadows that choose."""

    BLOCK_TOKENS = 32
    RATE = 1 / 64
    MIN_SHADOW_BLOCKS = 128
    EPOCH_BLOCKS = 64  # sampled blocks per epoch: the choice is made at each epoch's end
    DECAY = 0.9  # each epoch's end scales every score by this: a window of about 1 / (1 - DECAY) epochs
    INITIAL = "lfu"  # the live heap's first order (tuned: starting on LRU lost more on the tuning seeds' short runs)
    MARGIN = 0.01  # of the window's sampled lookup tokens: a lead smaller than this keeps the current choice

    def __init__(
        self, ranks: Mapping[str, Callable[[Any], Rank]], tie_break: Callable[[Any], int], capacity_len: int
    ) -> None:
        self.names = list(ranks)
        self._ranks, self._tie_break = ranks, tie_break
        blocks = capacity_len / self.BLOCK_TOKENS
        self.rate = min(1.0, max(self.RATE, self.MIN_SHADOW_BLOCKS / max(blocks, 1.0)))
        self._sampler = BlockSampler(self.BLOCK_TOKENS, self.rate)
        shadow_blocks = int(self.rate * blocks)
        self.shadows = {name: SHADOWS[name](shadow_blocks, self.BLOCK_TOKENS) for name in ranks}
        self.choice = self.INITIAL if self.INITIAL in ranks else self.names[0]
        self._bind(CandidateHeap(ranks[self.choice], tie_break, True))
        self.lookup_tokens = 0.0  # sampled tokens looked up in the current window (decayed as the scores)
        self._epoch_blocks = 0
        self.switches = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, member: object) -> bool:
        return member in self._heap

    def __iter__(self) -> Iterator[Any]:
        return iter(self._heap)

    def _bind(self, heap: CandidateHeap[Any]) -> None:
        """Serve the tree's calls from ``heap`` directly: the hot path costs what LRU's does, no extra frame."""
        self._heap = heap
        self.add, self.discard, self.refresh, self.pop = heap.add, heap.discard, heap.refresh, heap.pop

    def note_miss(self, ghost_key: Hashable, now: float) -> None:
        """Ghosts teach this set nothing: the shadows see every sampled request whole."""

    def note_lookup(self, key: RadixKey, now: float) -> None:
        """A request looks ``key`` up: each shadow counts the sampled blocks it holds (its hits)."""
        names = self._sampler.sampled(key)
        if not names:
            return
        for shadow in self.shadows.values():
            shadow.lookup(names)
        self.lookup_tokens += len(names) * self.BLOCK_TOKENS
        self._epoch_blocks += len(names)
        if self._epoch_blocks >= self.EPOCH_BLOCKS:
            self._end_epoch()

    def note_finished(self, key: RadixKey, now: float) -> None:
        """A finished request's sequence: its sampled blocks are reused or added in every shadow."""
        names = self._sampler.sampled(key)
        if names:
            for shadow in self.shadows.values():
                shadow.insert(names)

    def _end_epoch(self) -> None:
        """Switch to the leading shadow's order if it leads by the margin; then halve every score."""
        self._epoch_blocks = 0
        scores = {name: shadow.hit_tokens for name, shadow in self.shadows.items()}
        leader = max(self.names, key=lambda name: (scores[name], name == self.choice))
        if scores[leader] - scores[self.choice] > self.MARGIN * self.lookup_tokens:
            self.choose(leader)
        for shadow in self.shadows.values():
            shadow.hit_tokens *= self.DECAY
        self.lookup_tokens *= self.DECAY

    def choose(self, name: str) -> None:
        """Evict by ``name``'s order from now on: the live heap is rebuilt under its rank (O(n))."""
        heap: CandidateHeap[Any] = CandidateHeap(self._ranks[name], self._tie_break, True)
        for member in self._heap:
            heap.add(member)
        self._bind(heap)
        self.choice = name
        self.switches += 1

    def check(self) -> None:
        self._heap.check()
        for shadow in self.shadows.values():
            assert shadow.size == len(shadow.order()) <= shadow.capacity, "a shadow past its capacity"
