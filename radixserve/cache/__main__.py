"""The tree runs standalone: ``python -m radixserve.cache``.

Inserts the chapter's five sequences, printing the tree after each (watch
[1, 2, 3] split into [1, 2] -> [3] when [1, 2, 4, 5] arrives), then matches
[1, 2, 3, 13, 14] and evicts everything unlocked.
"""

from __future__ import annotations

from radixserve.cache import RadixCache, RadixKey
from radixserve.memory import TokenAllocator


def main() -> None:
    cache = RadixCache(TokenAllocator(64))
    for token_ids in ([1, 2, 3], [1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
        req = cache.open_request(RadixKey(token_ids))
        cached = req.cache_protected_len
        cache.extend_request(req, token_ids[cached:])
        cache.cache_finished_req(req)
        print(f"\ninsert {token_ids}  (cached prefix: {cached} tokens)")
        cache.pretty_print()
        cache.check_invariants()

    query = [1, 2, 3, 13, 14]
    indices, node = cache.match_prefix(RadixKey(query))
    print(f"\nmatch {query} -> {len(indices)} tokens cached, KV slots {indices.tolist()}, last node {node}")
    print(f"evict all: freed {cache.evict(cache.evictable_size())} slots; {cache.allocator.free_size()} free")


if __name__ == "__main__":
    main()
