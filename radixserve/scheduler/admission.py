"""PrefillAdder: which waiting requests (and how much of each) join this step's prefill.

Three limits, checked per request in policy order:
- a prefill token budget per step (``chunked_prefill_size``): a prompt longer
  than what is left of it is prefilled in chunks across steps;
- a cap on running requests;
- memory: the new tokens must fit in free slots plus what eviction can
  reclaim (``evictable_size``, counted *after* this request locked its prefix),
  minus headroom reserved for the running requests' future decode tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache import BasePrefixCache, CacheReq
from radixserve.scheduler.request import Request

# Decode headroom reserved per running request, at most this many tokens each:
# enough that admitting a prefill does not force an immediate retraction.
DECODE_RESERVE_CLIP = 64


def decode_reserve(running: list[Request]) -> int:
    """Slots to keep for the running requests' next decode tokens."""
    return sum(min(r.params.max_new_tokens - len(r.output_ids), DECODE_RESERVE_CLIP) for r in running)


@dataclass
class PrefillAdder:
    cache: BasePrefixCache
    budget: int  # prefill tokens left in this step
    requests_left: int  # requests it may still admit (the running-request cap minus those running)
    reserve: int  # decode headroom to keep

    def room(self) -> int:
        """Tokens this step can still prefill, by memory and by budget."""
        memory = self.cache.allocator.free_size() + self.cache.evictable_size() - self.reserve
        return min(self.budget, memory)

    def add(self, req: Request, kv: CacheReq, target_len: int) -> int:
        """Allocate the next chunk of ``req`` (up to ``target_len`` tokens computed); return its size.

        0 means nothing could be added (budget or memory), and nothing changed.
        The caller locked ``kv``'s prefix already, so eviction cannot take it.
        """
        todo = target_len - len(kv.token_ids)
        take = min(todo, self.room())
        if take <= 0:
            return 0
        start = len(kv.token_ids)
        if not self.cache.extend_request(kv, req.fill_ids[start : start + take]):
            return 0
        req.chunk_start = start
        self.budget -= take
        return take
