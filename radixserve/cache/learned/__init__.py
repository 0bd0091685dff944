"""The learned eviction policy (``--radix-eviction-policy learned``): ARC over the radix tree's leaves.

    candidates.py   ``LearnedCandidates``: seen-once and reused leaves, each LRU; T1's share learned from ghosts

It imports only core/candidates.py of the cache: core/policy.py builds it for the tree.
"""
