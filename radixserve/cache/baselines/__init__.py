"""The variants the radix tree is measured against, behind the same contract (core/base.py).

block.py        ``BlockHashCache``: vLLM-style chained-hash blocks with an LRU free queue (``--prefix-cache block``)
block_check.py  its invariant checker and printer
chunk.py        ``ChunkCache``: the control that never matches (``--prefix-cache none``)
"""
