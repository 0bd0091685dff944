"""Memory layer: KV slot allocation (and, later, the KV pool tensors)."""

from radixserve.memory.allocator import AllocatorError, IndexArray, TokenAllocator

__all__ = ["AllocatorError", "IndexArray", "TokenAllocator"]
