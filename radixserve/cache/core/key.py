"""RadixKey: a token sequence inside a cache namespace, and the hash chain over pages.

A namespace (``extra_key``: a LoRA adapter, a tenant's ``cache_salt``) splits
the cache into disjoint subtrees: it is part of every child key, so identical
tokens under different namespaces never share a node, and comparing keys of two
namespaces is a bug that raises instead of silently matching.

A key may start with a *shared head*: its first ``shared_len`` tokens live in the
shared namespace (None), the rest in ``extra_key``. That is how an operator's
allowlisted public prefix (a common system prompt) is shared across tenants
while everything after it stays private. A tree edge is always in one
namespace; a match never runs past the end of a head that differs from the
edge's namespace. The split is the key's own business: the tree, the KV events
and the scheduler pass keys around and ask them (``head_len``, ``namespace_at``,
``page_hashes``), never a token list plus a length.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Hashable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

TokenArray = npt.NDArray[np.int64]

ROOT_HASH = b"\x00" * 16  # the parent hash of every first page

# Up to this many tokens one vectorised compare beats galloping (measured: a 4k-token
# compare costs about as much as the numpy call overhead of two gallop steps).
_GALLOP_MIN = 4096


class RadixKey:
    """``token_ids`` (int64, viewed, never copied by slicing) plus a namespace."""

    __slots__ = ("token_ids", "extra_key", "shared_len", "_head")

    def __init__(
        self, token_ids: Sequence[int] | TokenArray, extra_key: str | None = None, shared_len: int = 0
    ) -> None:
        self.token_ids: TokenArray = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        self.extra_key = extra_key
        self._set_head(min(shared_len, len(self.token_ids)))

    @classmethod
    def _derived(cls, token_ids: TokenArray, extra_key: str | None, head: int) -> RadixKey:
        """A key over an int64 array already flat (no conversion: slicing is the tree's hot path)."""
        key = cls.__new__(cls)
        key.token_ids, key.extra_key = token_ids, extra_key
        key._set_head(head)
        return key

    def _set_head(self, head: int) -> None:
        # ``shared_len``: leading tokens in the shared namespace (only under a namespace), at most
        # the key's length. ``_head`` remembers the head a prefix was cut from, so a key that grows
        # back (``extended``: a request computing its prompt chunk by chunk) gets its head back.
        self._head = max(head, 0) if self.extra_key is not None else 0
        self.shared_len = min(self._head, len(self.token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, item: slice) -> RadixKey:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError("RadixKey supports slicing only (step 1)")
        start, stop, _ = item.indices(len(self.token_ids))
        if start == 0 and stop == len(self.token_ids):
            return self  # the whole key (keys are not mutated once built, except by the tree on its own edges)
        return RadixKey._derived(self.token_ids[item], self.extra_key, self._head - start)

    def extended(self, token_ids: Sequence[int] | TokenArray) -> RadixKey:
        """This key followed by ``token_ids``, in the same namespace (and shared head)."""
        tokens = np.concatenate([self.token_ids, np.asarray(token_ids, dtype=np.int64).reshape(-1)])
        return RadixKey._derived(tokens, self.extra_key, self._head)

    def copy(self) -> RadixKey:
        """The same key over its own copy of the tokens."""
        return RadixKey._derived(self.token_ids.copy(), self.extra_key, self._head)

    @classmethod
    def join(cls, edges: Sequence[RadixKey]) -> RadixKey:
        """The key of a path of one-namespace edges, root first (a shared head, then one namespace)."""
        if not edges:
            return cls([])
        extra_key = edges[-1].extra_key
        shared = sum(len(edge) for edge in edges if edge.extra_key is None) if extra_key is not None else 0
        return cls(np.concatenate([edge.token_ids for edge in edges]), extra_key, shared)

    def __repr__(self) -> str:
        head = self.token_ids[:10].tolist()
        more = "..." if len(self) > 10 else ""
        ns = f", extra_key={self.extra_key!r}" if self.extra_key is not None else ""
        shared = f", shared_len={self.shared_len}" if self.shared_len else ""
        return f"RadixKey({head}{more} len={len(self)}{ns}{shared})"

    @property
    def head_namespace(self) -> str | None:
        """The namespace of the key's first token."""
        return None if self.shared_len else self.extra_key

    @property
    def head_len(self) -> int:
        """How many leading tokens share ``head_namespace``."""
        return self.shared_len if 0 < self.shared_len < len(self.token_ids) else len(self.token_ids)

    @property
    def is_pure(self) -> bool:
        """Whether every token is in one namespace, ``extra_key`` (what a tree edge must be)."""
        return self.shared_len == 0

    def namespace_at(self, pos: int) -> str | None:
        """The namespace token ``pos`` is cached in."""
        return None if pos < self.shared_len else self.extra_key

    def pure(self) -> RadixKey:
        """This key in one namespace (its head's); for keys no longer than ``head_len``."""
        return RadixKey(self.token_ids, self.head_namespace)

    def aligned(self, page_size: int) -> RadixKey:
        """This key with its shared head rounded down to whole pages (a tree edge is whole pages)."""
        extra = self.shared_len % page_size
        return self if not extra else RadixKey(self.token_ids, self.extra_key, self.shared_len - extra)

    def page_hashes(self, page_size: int) -> Iterator[bytes]:
        """Chained hashes of each whole page (see ``page_hashes``), the shared head's in the shared namespace."""
        return page_hashes(self.token_ids, self.extra_key, page_size, shared_len=self.shared_len)

    def child_key(self, page_size: int) -> Hashable:
        """The dict key a child edge starting with this key is stored under.

        The first page of tokens, folded with the namespace: descent is one
        dict lookup, and two namespaces can never collide on a child.
        """
        if page_size == 1:
            first: Hashable = int(self.token_ids[0])
        else:
            first = tuple(self.token_ids[:page_size].tolist())
        ns = self.head_namespace
        return first if ns is None else (ns, first)

    def match(self, other: RadixKey, page_size: int = 1) -> int:
        """Length of the common prefix with ``other``, rounded down to ``page_size``.

        Stops where either key's head namespace ends. Raises ValueError if the
        two keys start in different namespaces.
        """
        if self.head_namespace != other.head_namespace:
            raise ValueError(
                f"RadixKey operations require matching extra_key: {self.head_namespace!r} != {other.head_namespace!r}"
            )
        matched = min(common_prefix_len(self.token_ids, other.token_ids), self.head_len, other.head_len)
        return matched - matched % page_size


def common_prefix_len(a: TokenArray, b: TokenArray) -> int:
    """Number of leading positions where ``a`` and ``b`` agree.

    Short runs: one vectorised compare. Long runs: gallop in doubling windows
    (one C-level compare each) so a divergence near the start costs little even
    on a 100k-token edge, then compare the window that holds the divergence.
    """
    n = min(len(a), len(b))
    if n <= _GALLOP_MIN:
        return _first_mismatch(a[:n], b[:n])
    lo, step = 0, _GALLOP_MIN
    while lo < n:
        hi = min(lo + step, n)
        if (a[lo:hi] != b[lo:hi]).any():
            return lo + _first_mismatch(a[lo:hi], b[lo:hi])
        lo, step = hi, step * 2
    return n


def _first_mismatch(a: TokenArray, b: TokenArray) -> int:
    if not len(a):
        return 0
    diff = a != b
    index = int(diff.argmax())
    return index if diff[index] else len(a)


def chain_hash(parent: bytes, extra_key: str | None, token_ids: TokenArray) -> bytes:
    """Hash of one page chained from its parent page's hash, inside a namespace.

    blake2b, not Python's ``hash``: the block cache trusts a hash match as a
    KV match, so collisions must be infeasible even for crafted inputs. The
    namespace is length-prefixed (domain separation: no two namespace/token
    pairs serialise alike). One C call over one buffer: this is the block
    cache's hot loop.
    """
    return next(page_hashes(token_ids, extra_key, len(token_ids), parent))


def page_hashes(
    token_ids: TokenArray, extra_key: str | None, page_size: int, parent: bytes = ROOT_HASH, shared_len: int = 0
) -> Iterator[bytes]:
    """Chained hashes of each whole page of ``token_ids``, computed as they are consumed.

    The tokens are serialised once and pages hashed from byte slices: a lookup
    that stops at the first miss hashes no further. Pages starting before
    ``shared_len`` are hashed in the shared namespace (a key's shared head).
    """
    data = np.ascontiguousarray(token_ids, dtype=np.int64).tobytes()
    tag, step, blake2b = _namespace_tag(extra_key), 8 * page_size, hashlib.blake2b
    shared_tag, shared_bytes = _namespace_tag(None), 8 * shared_len
    for offset in range(0, len(data) - step + 1, step):
        page_tag = shared_tag if offset < shared_bytes else tag
        parent = blake2b(parent + page_tag + data[offset : offset + step], digest_size=16).digest()
        yield parent


@functools.lru_cache(maxsize=4096)
def _namespace_tag(extra_key: str | None) -> bytes:
    if extra_key is None:
        return b"\xff\xff\xff\xff"
    ns = extra_key.encode()
    return len(ns).to_bytes(4, "little") + ns
