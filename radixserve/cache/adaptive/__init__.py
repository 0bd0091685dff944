"""The adaptive eviction policy (``--radix-eviction-policy adaptive``): depth, recency and frequency, weighed online.

    candidates.py   ``AdaptiveCandidates``: the candidate set the policy ranks leaves in (the module says how)
    class_heaps.py  one heap per hit class and group, and one by recency alone
    duels.py        two orders disagree on a victim: whichever place a request reaches first votes
    ghosts.py       evicted leaves remembered by where they hung: a lookup that stops there learns

It imports nothing else of the cache: core/policy.py builds it for the tree.
"""
