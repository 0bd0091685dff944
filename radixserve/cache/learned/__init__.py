"""The learned eviction policy (``--radix-eviction-policy learned``): nested ARC over the radix tree's leaves.

    candidates.py   ``LearnedCandidates``: reused / seen-once (top level, below) segments; shares learned from ghosts
    minisim.py      the ``minisim`` policy's shadows: spatially sampled blocks, LRU / SLRU / LFU over them
    dueling.py      ``DuelingCandidates``: the live leaves ranked by the fixed policy whose shadow leads
    when.py         ``WhenCandidates`` (``when``): the leaf least likely to be read within the pool's horizon, from
                    reuse gaps learned per class of leaf

They import only core/candidates.py and core/key.py of the cache: core/policy.py builds it for the tree.
"""
