import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.cache.core.key import RadixKey, chain_hash, common_prefix_len


def brute_force_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(
    shared=st.integers(0, 20_000),
    a_tail=st.lists(st.integers(0, 3), max_size=5),
    b_tail=st.lists(st.integers(0, 3), max_size=5),
)
def test_common_prefix_len_equals_brute_force_on_long_runs(shared: int, a_tail: list[int], b_tail: list[int]) -> None:
    base = list(range(shared))
    a, b = base + a_tail, base + b_tail
    assert common_prefix_len(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) == brute_force_prefix_len(a, b)


@given(
    st.lists(st.integers(0, 2), max_size=40), st.lists(st.integers(0, 2), max_size=40), st.sampled_from([1, 2, 4, 16])
)
def test_match_rounds_down_to_page_size(a: list[int], b: list[int], page_size: int) -> None:
    expected = brute_force_prefix_len(a, b)
    assert RadixKey(a).match(RadixKey(b), page_size) == expected - expected % page_size


def test_child_key_is_first_page_folded_with_namespace() -> None:
    assert RadixKey([7, 8, 9]).child_key(1) == 7
    assert RadixKey([7, 8, 9]).child_key(2) == (7, 8)
    assert RadixKey([7, 8, 9], "salt").child_key(2) == ("salt", (7, 8))
    assert RadixKey([7], "a").child_key(1) != RadixKey([7], "b").child_key(1)


def test_slicing_keeps_namespace_and_views_tokens() -> None:
    key = RadixKey(list(range(10)), "ns")
    tail = key[4:]
    assert tail.extra_key == "ns" and tail.token_ids.tolist() == list(range(4, 10))
    with pytest.raises(TypeError):
        key[3]  # type: ignore[index]


def test_chain_hash_depends_on_parent_namespace_and_tokens() -> None:
    page = np.arange(16, dtype=np.int64)
    h = chain_hash(b"\x00" * 16, None, page)
    assert chain_hash(b"\x00" * 16, None, page) == h
    assert chain_hash(b"\x01" * 16, None, page) != h
    assert chain_hash(b"\x00" * 16, "", page) != h  # empty salt is not "no salt"
    assert chain_hash(b"\x00" * 16, "a", page) != chain_hash(b"\x00" * 16, "b", page)
    assert chain_hash(b"\x00" * 16, None, page + 1) != h
