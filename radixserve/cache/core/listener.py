"""What a cache tells the parts attached to it when it was built: the KV event log, the tier index.

A listener is handed to the cache's constructor (``listeners=``; the tier index
through ``tiers=``, which also makes it one) and hears every change of what the
pool caches, in the order the listeners were given, the tier index last::

    on_insert(key, slots, start)   the cache now holds key[start:] (whole pages)
    on_evict(key, slots, start)    the cache is about to free key[start:]: its K/V is still readable
    on_clear()                     everything cached is gone (``reset``)

``key`` is the whole cached sequence up to the change's end (its namespaces and
shared head included), so a listener never needs the cache's nodes. ``slots`` are
the KV slots of ``key``'s last ``len(slots)`` tokens, at least ``key[start:]``: the
radix tree passes the whole path (``len(slots) == len(key)``), which the tier index
needs to copy a tier page that starts before ``start``; the block cache passes the
run it stores or frees. On insert, slots before ``start`` may be the caller's
duplicates of the cache's (same K/V); the caller frees them after ``insert`` returns.

Called on the thread that owns the cache, in the middle of the operation: a
listener records or copies, and never calls back into the cache.
"""

from __future__ import annotations

from typing import Protocol

from radixserve.cache.core.key import RadixKey
from radixserve.memory.allocator import IndexArray


class CacheListener(Protocol):
    def on_insert(self, key: RadixKey, slots: IndexArray, start: int) -> None: ...
    def on_evict(self, key: RadixKey, slots: IndexArray, start: int) -> None: ...
    def on_clear(self) -> None: ...
