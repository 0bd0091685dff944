"""The learned eviction policy (``--radix-eviction-policy learned``): nested ARC over the radix tree's leaves.

    candidates.py   ``LearnedCandidates``: reused / seen-once (top level, below) segments; shares learned from ghosts

It imports only core/candidates.py of the cache: core/policy.py builds it for the tree.
"""
