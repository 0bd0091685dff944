"""A tier page's label survives its bytes exactly, and comes back only for the page it was written for."""

from __future__ import annotations

import numpy as np

from radixserve.cache.core.key import RadixKey, page_hashes
from radixserve.cache.events import PageLabel
from radixserve.cache.tiers.labels import decode_label, encode_label


def labels_of(key: RadixKey, size: int) -> tuple[list[bytes], list[PageLabel]]:
    hashes = list(page_hashes(key.token_ids, key.extra_key, size, shared_len=key.shared_len))
    labels = [
        PageLabel(hashes[i - 1] if i else None, key.token_ids[i * size : (i + 1) * size], key.extra_key, 0)
        for i in range(len(hashes))
    ]
    return hashes, labels


def test_labels_round_trip_in_a_namespace_and_its_shared_head() -> None:
    key = RadixKey(np.arange(100, 148, dtype=np.int64), "tenant-ä", shared_len=16)  # page 0 in the shared head
    hashes, labels = labels_of(key, 16)
    for page_hash, label in zip(hashes, labels):
        back = decode_label(encode_label(label), page_hash, 16)
        assert back is not None
        assert (back.parent_hash, back.token_ids.tolist(), back.extra_key) == (
            label.parent_hash,
            label.token_ids.tolist(),
            label.extra_key,
        )


def test_a_label_is_refused_for_another_page_or_cut_short() -> None:
    hashes, labels = labels_of(RadixKey(np.arange(3, 35, dtype=np.int64), "a"), 16)
    data = encode_label(labels[1])
    assert decode_label(data, hashes[1], 16) is not None
    assert decode_label(data, hashes[0], 16) is None  # it does not hash to page 0
    assert decode_label(data, hashes[1], 8) is None  # not a page of 8 tokens
    assert decode_label(data[:-1], hashes[1], 16) is None and decode_label(b"", hashes[1], 16) is None
    other_ns = encode_label(PageLabel(labels[1].parent_hash, labels[1].token_ids, "b", 0))
    assert decode_label(other_ns, hashes[1], 16) is None  # the namespace is part of the page's hash
