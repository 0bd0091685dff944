"""The routing table: replica views, in-flight counts, the policies, and a precise index fed by KV events.

No Ray: the table is driven directly, as the Ray Serve adapter drives it. The
precise tests publish a real RadixCache's events over ZMQ to a router that
joins late and must rebuild the replica's blocks from a snapshot, then follow.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from radixserve.cache import KVEventLog, RadixCache, RadixKey
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.kv_events.wire import block_hashes
from radixserve.memory import TokenAllocator
from radixserve.router import table as table_module
from radixserve.router.choice import RouterConfig
from radixserve.router.table import RouteKey, RoutingTable, common_prefix_len

BLOCK = 16
SYSTEM = tuple(range(100, 164))  # 64 tokens every request below starts with


def key(*tails: Sequence[int], namespace: str | None = None, shared_len: int = 0) -> RouteKey:
    tokens = tuple(SYSTEM) + tuple(t for tail in tails for t in tail)
    return RouteKey(tokens, namespace, shared_len)


def entry(table: RoutingTable, replica: str) -> dict[str, Any]:
    return next(r for r in table.describe()["replicas"] if r["replica"] == replica)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def table() -> Iterator[RoutingTable]:
    table = RoutingTable(index="approximate")
    table.sync({"a": {}, "b": {}})
    yield table
    table.close()


# ---- the approximate index -----------------------------------------------------------------------


def test_a_shared_prefix_follows_the_replica_it_was_routed_to(table: RoutingTable) -> None:
    table.routed("a", "r1", key([1, 2, 3]))
    assert table.choose(["a", "b"], key([7, 8])) == [["a"], ["b"]]
    table.completed("a", "r1")  # no longer in flight: the index alone remembers it
    assert table.choose(["a", "b"], key([9])) == [["a"], ["b"]]
    assert table.choose(["b", "a"], key([9])) == [["a"], ["b"]]  # whatever the candidates' order
    assert table.decisions == Counter(prefix=3)
    assert entry(table, "a")["index"] == {"kind": "approximate", "tokens": len(SYSTEM) + 3}
    assert entry(table, "b")["index"] == {"kind": "approximate", "tokens": 0}


def test_another_namespace_never_matches_and_ties_take_turns(table: RoutingTable) -> None:
    table.routed("a", "r1", key([1, 2, 3]))
    assert table.views["a"].match(key([1, 2, 3], namespace="tenant")) == 0  # in flight: same rule
    table.completed("a", "r1")
    picks = [table.choose(["a", "b"], key([1, 2, 3], namespace="tenant"))[0][0] for _ in range(6)]
    assert picks.count("a") == picks.count("b") == 3  # least-loaded, ties rotating: not always "a"
    assert table.decisions == Counter({"least-loaded": 6})
    assert table.views["a"].match(key([1, 2, 3], namespace="tenant")) == 0
    assert table.views["a"].match(key([1, 2, 3])) == len(SYSTEM) + 3


def test_a_shared_head_matches_across_namespaces_its_private_part_does_not(table: RoutingTable) -> None:
    head = len(SYSTEM)
    table.routed("a", "r1", key([1, 2, 3], namespace="t1", shared_len=head))
    table.completed("a", "r1")
    view = table.views["a"]
    assert view.match(key([1, 2, 3], namespace="t1", shared_len=head)) == head + 3
    # Another tenant with the same public head: the head matches, the identical private tokens do not.
    assert view.match(key([1, 2, 3], namespace="t2", shared_len=head)) == head
    # The head lives in the shared namespace: a request without a namespace finds it as well ...
    assert view.match(key([1, 2, 3])) == head
    # ... but the same tokens as t2's private ones (no shared head) do not.
    assert view.match(key([1, 2, 3], namespace="t2")) == 0
    assert table.choose(["b", "a"], key([5], namespace="t2", shared_len=head)) == [["a"], ["b"]]
    assert table.decisions["prefix"] == 1


def test_a_short_match_is_not_a_prefix_decision(table: RoutingTable) -> None:
    table.routed("a", "r1", RouteKey((1, 2, 3)))
    table.completed("a", "r1")
    long_tail = tuple(range(1000, 1100))
    table.choose(["a", "b"], RouteKey((1, 2) + long_tail))  # 2 of 102 tokens < min_match_fraction
    table.choose(["a", "b"], RouteKey((1, 2) + long_tail))
    assert table.decisions == Counter({"least-loaded": 2})


# ---- in flight and load --------------------------------------------------------------------------


def test_in_flight_counts_until_completed_and_load_is_the_larger_of_mine_and_reported(table: RoutingTable) -> None:
    table.routed("a", "r1", key([1]))
    table.routed("a", "r2", key([2]))
    assert table.load("a", None) == 2 and table.load("b", None) == 0
    assert entry(table, "a")["in_flight"] == 2 and entry(table, "a")["routed"] == 2
    table.completed("a", "r1")
    table.completed("a", "unknown")  # a request this router never saw: nothing changes
    assert table.load("a", None) == 1 and entry(table, "a")["in_flight"] == 1
    assert table.load("a", {"requests": 5}) == 5  # the replica knows of more (other routers' traffic)
    assert table.load("a", {"requests": 0}) == 1  # a stale report: what is in flight here still counts
    assert table.load("a", {"requests": "many"}) == 1
    table.reports = lambda: {"a": {"requests": 7}}
    a = entry(table, "a")
    assert a["load"] == 7 and a["reported"] == {"requests": 7} and a["in_flight"] == 1
    table.completed("a", "r2")
    assert entry(table, "a")["in_flight"] == 0 and entry(table, "a")["routed"] == 2


def test_routed_to_an_unknown_replica_or_with_a_target_is_not_in_flight(table: RoutingTable) -> None:
    table.routed("zzz", "r1", key([1]))
    assert "zzz" not in table.views
    table.routed("a", "r2", RouteKey(target="a"))  # a flush sent to each replica: no routing decision
    assert entry(table, "a")["routed"] == 0 and entry(table, "a")["in_flight"] == 0
    table.routed("a", "r3", None)  # routed, but nothing to follow
    assert entry(table, "a")["routed"] == 1 and entry(table, "a")["in_flight"] == 0


def test_a_request_counts_in_flight_from_the_decision_and_moves_when_it_spills(
    table: RoutingTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert table.choose(["a", "b"], key([1]), request_id="r1") == [["a"], ["b"]]
    assert table.load("a", None) == 1  # before any confirmation: a burst does not all go to "a"
    assert table.choose(["a", "b"], RouteKey((5, 6, 7)), request_id="r2") == [["b"], ["a"]]  # no match: b
    table.routed("b", "r1", key([1]))  # "a" refused r1 (at its cap): it went to "b"
    assert (entry(table, "a")["in_flight"], entry(table, "b")["in_flight"]) == (0, 2)
    table.completed("b", "r1")
    assert (entry(table, "a")["in_flight"], entry(table, "b")["in_flight"]) == (0, 1)
    monkeypatch.setattr(table_module, "UNCONFIRMED_S", 0.0)
    table.choose(["a", "b"], key([3]))  # r2 was chosen, never confirmed sent: forgotten
    assert entry(table, "b")["in_flight"] == 0


def test_the_rest_are_ranked_least_loaded_first(table: RoutingTable) -> None:
    table.sync({"a": {}, "b": {}, "c": {}})
    table.routed("a", "r1", key([1]))
    reported = {"b": {"requests": 3}, "c": {"requests": 0}}
    assert table.choose(["a", "b", "c"], key([2]), reported) == [["a"], ["c", "b"]]
    assert table.choose(["a", "b", "c"], None, reported) == [["c"], ["a", "b"]]  # no key: the least loaded
    assert table.choose(["a", "b", "c"], RouteKey(), reported) == [["c"], ["a", "b"]]
    assert table.decisions == Counter({"prefix": 1, "least-loaded": 2})
    assert table.choose(["b"], key([2])) == [["b"]]
    assert table.choose([], key([2])) == []


# ---- imbalance -----------------------------------------------------------------------------------


def test_imbalance_overrides_the_prefix_match() -> None:
    table = RoutingTable(index="approximate", config=RouterConfig(abs_threshold=2, rel_threshold=1.5))
    table.sync({"a": {}, "b": {}})
    table.routed("a", "r1", key([1]))
    table.completed("a", "r1")
    heavy = {"a": {"requests": 10}, "b": {"requests": 0}}
    assert table.choose(["a", "b"], key([2]), heavy) == [["b"], ["a"]]
    assert table.decisions == Counter(balance=1)
    balanced = {"a": {"requests": 3}, "b": {"requests": 2}}
    assert table.choose(["a", "b"], key([2]), balanced) == [["a"], ["b"]]
    assert table.decisions == Counter(balance=1, prefix=1)
    for i in range(3):  # what this router has in flight counts too, reports or not
        table.routed("a", f"q{i}", key([3]))
    assert table.choose(["a", "b"], key([2])) == [["b"], ["a"]]
    assert table.decisions["balance"] == 2


# ---- target --------------------------------------------------------------------------------------


def test_a_target_pins_the_request_to_one_replica(table: RoutingTable) -> None:
    table.routed("a", "r1", key([1]))
    assert table.choose(["a", "b"], RouteKey(key([1]).tokens, target="b")) == [["b"]]
    assert table.choose(["a", "b"], RouteKey(target="zzz")) == []
    assert table.choose(["a"], RouteKey(target="b")) == []
    assert table.decisions == Counter()  # not a routing decision


# ---- policies ------------------------------------------------------------------------------------


def test_round_robin_cycles_through_the_candidates_whatever_they_hold() -> None:
    table = RoutingTable("round-robin", index="approximate")
    table.sync({"a": {}, "b": {}, "c": {}})
    table.routed("a", "r1", key([1]))
    picks = [table.choose(["a", "b", "c"], key([1]))[0][0] for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert table.decisions == Counter({"round-robin": 6})


def test_power_of_two_never_picks_the_more_loaded() -> None:
    table = RoutingTable("power-of-two", index="approximate", seed=0)
    two = {"a": {"requests": 5}, "b": {"requests": 1}}
    assert {table.choose(["a", "b"], key([1]), two)[0][0] for _ in range(20)} == {"b"}
    three = {"a": {"requests": 9}, "b": {"requests": 1}, "c": {"requests": 5}}
    picks = Counter(table.choose(["a", "b", "c"], key([1]), three)[0][0] for _ in range(60))
    assert picks["a"] == 0 and picks["b"] > 0 and picks["c"] > 0  # c wins only when drawn with a
    assert table.decisions == Counter({"power-of-two": 80})


@pytest.mark.parametrize("kwargs", [{"policy": "random"}, {"index": "exact"}])
def test_an_unknown_policy_or_index_is_an_error(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        RoutingTable(**kwargs)  # type: ignore[arg-type]


# ---- the replica set -----------------------------------------------------------------------------


def test_a_replica_gone_from_sync_loses_its_view_and_a_new_id_starts_empty(table: RoutingTable) -> None:
    table.routed("a", "r1", key([1]))
    table.completed("a", "r1")
    table.sync({"a": {}, "b": {}})  # the same set again: nothing forgotten
    assert table.views["a"].match(key([1])) == len(SYSTEM) + 1
    table.sync({"b": {}, "a2": {}})  # "a" restarted as "a2"
    assert [r["replica"] for r in table.describe()["replicas"]] == ["a2", "b"]
    assert entry(table, "a2")["index"] == {"kind": "approximate", "tokens": 0}
    table.routed("a", "r2", key([1]))  # late news from the gone replica: ignored
    assert "a" not in table.views
    picks = {table.choose(["a2", "b"], key([1]))[0][0] for _ in range(2)}
    assert picks == {"a2", "b"} and table.decisions == Counter({"least-loaded": 2})
    table.remove("b")
    assert [r["replica"] for r in table.describe()["replicas"]] == ["a2"]


def test_a_candidate_routed_before_sync_gets_a_view(table: RoutingTable) -> None:
    assert table.choose(["c"], key([1])) == [["c"]]
    table.routed("c", "r1", key([1]))
    assert entry(table, "c")["in_flight"] == 1


# ---- the precise index, fed by a real publisher --------------------------------------------------


class Replica:
    """A RadixCache with KV events on, publishing each change as one batch."""

    def __init__(self) -> None:
        self.cache = RadixCache(TokenAllocator(4096), listeners=[KVEventLog(1)])
        self.publisher = KVEventPublisher("tcp://127.0.0.1:*", block_size=BLOCK)

    def serve(self, prompt: Sequence[int], namespace: str | None = None, shared_len: int = 0) -> None:
        tokens = np.asarray(prompt, dtype=np.int64)
        req = self.cache.open_request(RadixKey(tokens, namespace, shared_len))
        assert self.cache.extend_request(req, tokens[len(req.token_ids) :])
        self.cache.cache_finished_req(req)
        self.publish()

    def publish(self) -> None:
        assert self.cache.events is not None
        self.publisher.publish(self.cache.events.drain())

    def metadata(self) -> dict[str, Any]:
        return {
            "kv_events_endpoint": self.publisher.endpoint,
            "kv_events_replay_endpoint": self.publisher.replay_endpoint,
            "kv_events_block_size": BLOCK,
        }


@pytest.fixture
def replica() -> Iterator[Replica]:
    replica = Replica()
    yield replica
    replica.publisher.close()


def blocks_of(*prompts: tuple[Sequence[int], str | None, int]) -> set[int]:
    return {h for tokens, ns, shared in prompts for h in block_hashes(RadixKey(tokens, ns, shared), BLOCK)}


def test_a_late_router_rebuilds_the_index_from_a_snapshot_then_follows(replica: Replica) -> None:
    first = (list(range(10, 50)), None, 0)  # 40 tokens: 2 whole blocks
    sibling = (list(range(10, 30)) + list(range(500, 520)), None, 0)  # shares block 0 with ``first``
    private = (list(range(200, 232)) + list(range(300, 316)), "t1", 32)  # a 32-token public head, then t1's
    for tokens, ns, shared in (first, sibling, private):
        replica.serve(tokens, ns, shared)
    expected = blocks_of(first, sibling, private)
    assert len(expected) == 6
    table = RoutingTable(index="precise")  # joins after every batch was published
    try:
        table.sync({"a": replica.metadata(), "b": {}})
        wait_for(lambda: entry(table, "a")["index"].get("snapshots", 0) >= 1, "a's snapshot")
        a = entry(table, "a")["index"]
        assert a["kind"] == "precise" and a["blocks"] == 6 and a["seq"] == replica.publisher.seq
        assert table.views["a"].mirror is not None and table.views["a"].mirror.blocks == expected
        assert entry(table, "b")["index"]["kind"] == "approximate"  # publishes nothing: the fallback

        assert table.choose(["b", "a"], RouteKey(tuple(first[0][:32]) + (999,))) == [["a"], ["b"]]
        assert table.decisions == Counter(prefix=1)
        assert table.views["a"].match(RouteKey(tuple(first[0]))) == 32  # whole blocks only
        assert table.views["a"].match(RouteKey(tuple(first[0]), namespace="t1")) == 0
        head = tuple(private[0][:32])
        assert table.views["a"].match(RouteKey(head + (1,) * 16, "t2", shared_len=32)) == 32
        assert table.views["a"].match(RouteKey(tuple(private[0]), "t2", shared_len=32)) == 32  # not t1's
        assert table.views["a"].match(RouteKey(tuple(private[0]), "t1", shared_len=32)) == 48

        time.sleep(0.2)  # let the SUB subscription reach the publisher (the snapshot came first)
        late = list(range(600, 648))
        new_key = RouteKey(tuple(late[:40]) + (7, 7))
        assert table.views["a"].match(new_key) == 0
        replica.serve(late)
        wait_for(lambda: entry(table, "a")["index"]["seq"] == replica.publisher.seq, "the new batch")
        assert entry(table, "a")["index"]["blocks"] == 9
        assert table.views["a"].match(new_key) == 32
        assert table.choose(["b", "a"], new_key) == [["a"], ["b"]]

        replica.cache.evict(replica.cache.evictable_size())  # "removed" events
        replica.publish()
        wait_for(lambda: entry(table, "a")["index"]["blocks"] == 0, "the removals")
        assert table.views["a"].match(new_key) == 0

        replica.serve(first[0])
        wait_for(lambda: entry(table, "a")["index"]["blocks"] == 2, "the stored blocks")
        replica.cache.reset()  # a flush: one "cleared" event
        replica.publish()
        wait_for(lambda: entry(table, "a")["index"]["blocks"] == 0, "the clear")
        assert table.views["a"].match(RouteKey(tuple(first[0]))) == 0
        assert entry(table, "a")["index"]["seq"] == replica.publisher.seq
    finally:
        table.close()


def test_a_precise_view_counts_prompts_in_flight_until_they_are_cached(replica: Replica) -> None:
    table = RoutingTable(index="precise")
    try:
        table.sync({"a": replica.metadata(), "b": {}})
        wait_for(lambda: entry(table, "a")["index"].get("snapshots", 0) >= 1, "a's snapshot")
        prompt = tuple(range(10, 50))
        table.routed("a", "r1", RouteKey(prompt))  # being prefilled: no event yet
        assert table.views["a"].index is None  # precise: nothing indexed on the router's side
        assert table.views["a"].match(RouteKey(prompt[:30] + (1,))) == 30
        assert table.choose(["b", "a"], RouteKey(prompt[:30] + (1,))) == [["a"], ["b"]]
        table.completed("a", "r1")
        assert table.views["a"].match(RouteKey(prompt[:30] + (1,))) == 0  # never cached (no event came)
    finally:
        table.close()


def test_a_gone_replica_stops_being_followed(replica: Replica) -> None:
    replica.serve(list(range(10, 50)))
    table = RoutingTable(index="precise")
    try:
        table.sync({"a": replica.metadata()})
        wait_for(lambda: entry(table, "a")["index"].get("blocks") == 2, "a's snapshot")
        view = table.views["a"]
        assert view.mirror is not None
        table.sync({})
        assert table.describe()["replicas"] == []
        wait_for(lambda: view.mirror is not None and view.mirror.socket.closed, "the subscriber to close")
    finally:
        table.close()


# A replica first heard of without KV-event endpoints (chosen before sync() saw it, or synced before it
# reported its metadata) gets an approximate index; a later sync() with its endpoints makes it precise.
@pytest.mark.parametrize("first_seen", ["choose", "sync"])
def test_metadata_that_arrives_later_upgrades_the_view_to_precise(replica: Replica, first_seen: str) -> None:
    table = RoutingTable(index="precise")
    try:
        if first_seen == "choose":
            table.choose(["a"], RouteKey((1, 2, 3)))
        else:
            table.sync({"a": {}})
        table.sync({"a": replica.metadata()})
        assert entry(table, "a")["index"]["kind"] == "precise"
    finally:
        table.close()


# ---- common_prefix_len ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a,b,n",
    [
        ((), (), 0),
        ((), (1, 2), 0),
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2, 4), 2),
        ((1, 2), (1, 2, 3), 2),
        ((1, 2, 3), (1,), 1),
        ((5,), (6,), 0),
        ((0, 1), (1, 0), 0),
    ],
)
def test_common_prefix_len(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    assert common_prefix_len(a, b) == n == common_prefix_len(b, a)


def test_common_prefix_len_on_long_runs_and_large_tokens() -> None:
    long = list(range(100_000))
    other = long.copy()
    other[77_777] = -1
    assert common_prefix_len(long, other) == 77_777
    assert common_prefix_len(long, long[:500]) == 500
    assert common_prefix_len([2**40, 1], [2**40, 2]) == 1
