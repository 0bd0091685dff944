"""The radix-tree prefix cache itself: the contract every variant answers, keys, the tree, and its eviction.

base.py         the contract (``BasePrefixCache``, ``CacheReq``, ``MatchResult``) and who owns which slot
key.py          ``RadixKey``: tokens in a namespace, page hashes, the one common-prefix function
radix.py        ``RadixCache`` and ``TreeNode``: the tree (``--prefix-cache radix``, the default)
candidates.py   ``CandidateHeap``: the evictable leaves, ranked incrementally (O(k log n) to evict k)
policy.py       the eviction strategies (``--radix-eviction-policy``) behind ``create_eviction_strategy``
radix_check.py  ``check_radix_invariants``: every structural invariant, checked by walking the tree
"""
