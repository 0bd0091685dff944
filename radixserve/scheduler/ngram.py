"""NgramIndex: where short token runs occur in what the prefix cache holds, and the tokens that followed there.

Drafts for speculative decoding (``draft.py``) come from here: the request's last few tokens are looked up,
and what followed them in a cached sequence (an earlier prompt or answer) is proposed as the next tokens.
The index is a cache listener (``cache/core/listener.py``), kept with the tree's inserts and evictions::

    (namespace, n-gram) -> (position, continuation)   the latest cached occurrence, and a copy of the
                                                       (at most ``max_continuation``) tokens after it

It holds no node, no slot and no lock: only copies of token ids, bounded by ``max_entries`` (the least
recently written entry goes first; ~400 bytes each with 8-token continuations: 26 MB at the default 65,536,
about the last 20k cached tokens' n-grams of three sizes; the 1-grams add one entry per distinct token).
Lookups try 4, 3 and 2 tokens; only a grammar request's drafts come from one token (``draft.py``). What it
returns is always cached in the tree at that moment: when the cache frees ``key[start:]``, every entry this
key wrote whose n-gram ends in the freed part is dropped, and one whose continuation runs into it is cut where
the freed part begins (an entry another sequence wrote since, at another position or with other tokens, is
left alone: that sequence still holds it).

Namespaces (``extra_key`` / cache_salt) never mix: an n-gram is looked up only in its own namespace, and a
continuation never crosses from a shared head into a private part.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache import RadixKey
from radixserve.memory.allocator import IndexArray

NGRAM_SIZES = (4, 3, 2)  # tried longest first: a longer match predicts better
INDEX_SIZES = (*NGRAM_SIZES, 1)  # indexed: 1-grams too, for a grammar request's last resort (draft.py)
Entry = tuple[int, tuple[int, ...]]  # (position of the n-gram's last token, the tokens after it)


class NgramIndex:
    """n-gram -> continuation over the cached sequences; a ``CacheListener``."""

    def __init__(
        self, max_continuation: int = 8, max_entries: int = 1 << 16, sizes: Sequence[int] = INDEX_SIZES
    ) -> None:
        if max_continuation < 1 or max_entries < 1 or not sizes or min(sizes) < 1:
            raise ValueError("max_continuation, max_entries and the n-gram sizes must be >= 1")
        self.max_continuation = max_continuation
        self.max_entries = max_entries
        self.sizes = tuple(sorted(sizes, reverse=True))
        self._entries: dict[tuple[str | None, tuple[int, ...]], Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, namespace: str | None, tail: Sequence[int], limit: int, sizes: Sequence[int] = NGRAM_SIZES
    ) -> tuple[int, list[int]]:
        """(n, up to ``limit`` tokens) that followed the longest n-gram ending ``tail`` in the cache, n of
        ``sizes`` (those the index holds); (0, [])."""
        for n in sizes:
            if n in self.sizes and len(tail) >= n:
                entry = self._entries.get((namespace, tuple(tail[-n:])))
                if entry is not None:
                    return n, list(entry[1][:limit])
        return 0, []

    # ---- CacheListener ----------------------------------------------------------------------

    def on_insert(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """Index the n-grams whose continuation the insert of ``key[start:]`` made or lengthened."""
        first, tokens = self._window(key, start)
        for n in self.sizes:
            for p in range(max(start - self.max_continuation, n - 1), len(key) - 1):
                namespace, end = self._scope(key, p - n + 1, p)
                if end <= p + 1:
                    continue
                ngram = tuple(tokens[p - n + 1 - first : p + 1 - first])
                entry = (p, tuple(tokens[p + 1 - first : min(end, p + 1 + self.max_continuation) - first]))
                self._entries.pop((namespace, ngram), None)  # re-inserted last: the most recently written
                self._entries[(namespace, ngram)] = entry
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]

    def on_evict(self, key: RadixKey, slots: IndexArray, start: int) -> None:
        """Forget, or cut short, what this key wrote about ``key[start:]``: the cache frees it."""
        first, tokens = self._window(key, start)
        for n in self.sizes:
            for p in range(max(start - self.max_continuation, n - 1), len(key) - 1):
                namespace, _ = self._scope(key, p - n + 1, p)
                index = (namespace, tuple(tokens[p - n + 1 - first : p + 1 - first]))
                entry = self._entries.get(index)
                if entry is None or entry[0] != p:
                    continue
                cont = entry[1]
                if cont != tuple(tokens[p + 1 - first : p + 1 + len(cont) - first]):
                    continue  # another sequence wrote it: still cached there
                if p + 1 >= start:
                    del self._entries[index]
                else:
                    self._entries[index] = (p, cont[: start - p - 1])

    def on_clear(self) -> None:
        self._entries.clear()

    def _window(self, key: RadixKey, start: int) -> tuple[int, list[int]]:
        """The part of ``key`` an insert or eviction at ``start`` touches: (its first position, its tokens)."""
        first = max(0, start - self.max_continuation - max(self.sizes))
        return first, key.token_ids[first:].tolist()

    @staticmethod
    def _scope(key: RadixKey, begin: int, end: int) -> tuple[str | None, int]:
        """The namespace of ``key[begin:end + 1]`` and where that namespace ends (begin + 0 when it straddles
        the shared head: not indexed)."""
        namespace = key.namespace_at(begin)
        if key.namespace_at(end) != namespace:
            return namespace, begin
        return namespace, key.shared_len if namespace is None and key.shared_len else len(key)
