"""Memory layer: KV slot allocation and the KV pool tensors (the host and disk tiers are cache/tiers/)."""

from radixserve.memory.allocator import AllocatorError, IndexArray, TokenAllocator

__all__ = ["AllocatorError", "IndexArray", "TokenAllocator"]
