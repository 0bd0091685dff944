"""Duels between two eviction orders: who is asked for first settles them, memory stays bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.adaptive.duels import Duels


def test_the_victim_first_votes_its_direction_and_the_kept_leaf_first_the_opposite() -> None:
    duels = Duels(8)
    duels.open("v", "k", +1)
    duels.open("w", "k", -1)
    assert duels.settle("v") == [+1] and len(duels) == 1
    assert duels.settle("v") == [0]  # settled once
    assert duels.settle("k") == [+1] and len(duels) == 0  # the kept leaf beat w's duel (direction -1)


def test_one_request_settles_every_duel_at_its_place() -> None:
    duels = Duels(8)
    for victim in "abc":
        duels.open(victim, "k", +1)
    assert duels.settle("k") == [-3] and len(duels) == 0


def test_the_oldest_duel_is_dropped_at_capacity() -> None:
    duels = Duels(2)
    for victim in "abc":
        duels.open(victim, "k", +1)
    assert len(duels) == 2 and duels.settle("a") == [0] and duels.settle("c") == [1]
    duels.check()


def test_kinds_vote_apart_and_fill_up_apart() -> None:
    """One index for every kind (one lookup per access); each kind keeps its own newest ``capacity`` duels."""
    duels = Duels(2, kinds=2)
    duels.open("a", "k", +1, kind=0)
    for victim in "bcd":
        duels.open(victim, "k", -1, kind=1)  # b is dropped: kind 1 is full, kind 0's older duel stays
    assert len(duels) == 3 and set(duels.index) == {"a", "c", "d", "k"}
    duels.check()
    assert duels.settle("k") == [-1, +2] and len(duels) == 0 and not duels.index


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("open"), st.integers(0, 5), st.integers(0, 5), st.sampled_from([-1, 1])),
            st.tuples(st.just("settle"), st.integers(0, 5), st.integers(0, 0), st.integers(0, 0)),
        ),
        max_size=60,
    )
)
def test_duels_match_a_list_of_open_duels(ops: list[tuple[str, int, int, int]]) -> None:
    """Against a plain list: open appends (dropping the oldest past capacity), settle closes every match."""
    duels, model = Duels(4), []
    for op, a, b, direction in ops:
        if op == "open":
            duels.open(a, b, direction)
            model.append((a, b, direction))
            model = model[-4:]
        else:
            expected = sum(d for v, _, d in model if v == a) - sum(d for v, k, d in model if k == a and v != a)
            model = [m for m in model if a not in (m[0], m[1])]
            assert duels.settle(a) == [expected]
        duels.check()
        assert len(duels) == len(model)
