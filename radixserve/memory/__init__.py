"""Memory layer: KV slot allocation, the KV pool tensors, and the host (L2) and disk (L3) page tiers."""

from radixserve.memory.allocator import AllocatorError, IndexArray, TokenAllocator

__all__ = ["AllocatorError", "IndexArray", "TokenAllocator"]
