"""The cache-aware choice as a pure function of match lengths and loads, and the router's prefix index."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from radixserve.cache import RadixKey
from radixserve.router.choice import PrefixIndex, RouterConfig, choose_replica, imbalanced

CONFIG = RouterConfig(abs_threshold=4, rel_threshold=1.5, min_match_fraction=0.25)


def test_the_longest_match_wins_when_load_is_balanced() -> None:
    assert choose_replica([0, 120, 80], [3, 4, 2], request_len=200, config=CONFIG) == 1


def test_equal_matches_go_to_the_less_loaded() -> None:
    assert choose_replica([100, 100, 0], [5, 3, 2], request_len=200, config=CONFIG) == 1


def test_imbalance_beyond_both_thresholds_goes_to_the_least_loaded() -> None:
    assert imbalanced([10, 2, 6], CONFIG) and not imbalanced([6, 3, 5], CONFIG)  # 3 <= abs threshold
    assert not imbalanced([105, 100], CONFIG)  # far apart in absolute terms, close in relative
    assert choose_replica([0, 120, 80], [3, 10, 2], request_len=200, config=CONFIG) == 2


def test_a_short_match_is_not_worth_giving_up_balance() -> None:
    assert choose_replica([10, 0, 0], [3, 1, 2], request_len=200, config=CONFIG) == 1  # 10 < 25% of 200


def test_ties_take_turns_never_always_replica_0() -> None:
    picks = Counter(choose_replica([0, 0, 0, 0], [1, 1, 1, 1], 50, CONFIG, turn=t) for t in range(400))
    assert set(picks) == {0, 1, 2, 3} and max(picks.values()) == min(picks.values())


def test_bad_input_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_replica([1, 2], [0], 10, CONFIG)


def test_prefix_index_matches_what_was_routed_per_namespace_and_forgets_lru() -> None:
    index = PrefixIndex(capacity=64)
    system = np.arange(3, 43)  # 40 tokens
    index.add(RadixKey(np.concatenate([system, [100, 101]])))
    assert index.match(RadixKey(np.concatenate([system, [200]]))) == 40
    assert index.match(RadixKey(np.concatenate([system, [200]]), "tenant")) == 0  # namespaces never match
    index.add(RadixKey(np.arange(500, 560)))  # 60 more tokens: the pool holds 64, the older prefix goes
    assert index.match(RadixKey(np.concatenate([system, [200]]))) < 40
    index.cache.check_invariants()
