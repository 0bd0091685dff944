"""What a router knows of its replicas, and the routing decision over it (no Ray here).

``RoutingTable`` keeps one ``ReplicaView`` per replica: its requests in flight
(what this router sent and has not seen finish) and an index of what the
replica has cached, either

- *approximate*: a ``PrefixIndex`` of the prompts this router sent there
  (LRU-bounded; blind to evictions and to other routers' traffic), or
- *precise*: a mirror of the replica's cached blocks, fed by its KV events
  (``--kv-events-endpoint``) on a background thread, plus the prompts in flight
  there (a prompt being prefilled is not cached yet, but the next request with
  its prefix should still follow it).

``RoutingTable.choose`` ranks the candidates: the policy's pick first, then the
rest by load, so a replica that refuses (at its concurrency cap) spills the
request to the next. The Ray Serve request router (``ray_serve.py``) is a thin
adapter over this class, which the tests drive directly as well.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from radixserve.cache import RadixKey
from radixserve.core import ROUTER_INDEXES, ROUTER_POLICIES
from radixserve.kv_events.subscriber import KVEventSubscriber
from radixserve.kv_events.wire import block_hashes
from radixserve.router.choice import PrefixIndex, RouterConfig, choose_replica, imbalanced

logger = logging.getLogger(__name__)

Reports = Mapping[str, Mapping[str, Any]]  # replica -> its last record_routing_stats
UNCONFIRMED_S = 30.0  # a request chosen but not confirmed sent for this long is no longer counted


@dataclass(frozen=True)
class RouteKey:
    """What routing needs of a request: its first prompt's tokens in its cache namespace.

    ``target`` pins the call to one replica (by its full id), e.g. a flush sent to each.
    """

    tokens: tuple[int, ...] = ()
    namespace: str | None = None
    shared_len: int = 0  # leading tokens in the shared namespace (an allowlisted public head)
    target: str | None = None

    def radix_key(self) -> RadixKey:
        """The cache key these tokens are looked up under (the replicas' own keying)."""
        return RadixKey(np.asarray(self.tokens, dtype=np.int64), self.namespace, self.shared_len)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


@dataclass
class ReplicaView:
    replica: str
    index: PrefixIndex | None = None  # approximate
    mirror: KVEventSubscriber | None = None  # precise (owned by the mirror thread)
    block_size: int = 16
    topic: str = ""  # the replica's KV events topic
    inflight: dict[str, RouteKey] = field(default_factory=dict)
    routed: int = 0

    def match(self, key: RouteKey) -> int:
        """Tokens of ``key`` this replica is believed to hold (or to be prefilling)."""
        radix_key = key.radix_key()
        best = 0
        if self.index is not None:
            best = self.index.match(radix_key)
        if self.mirror is not None:
            blocks = self.mirror.blocks  # read-only here; the mirror thread swaps or updates it
            held = 0
            for block in block_hashes(radix_key, self.block_size):
                if block not in blocks:
                    break
                held += 1
            best = max(best, held * self.block_size)
        for other in list(self.inflight.values()):
            if other.namespace == key.namespace:
                best = max(best, common_prefix_len(other.tokens, key.tokens))
        return best


class MirrorThread:
    """Owns every KV-event subscriber (ZMQ sockets stay on one thread): snapshot at start, then follow."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[tuple[str, ReplicaView, str, str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-mirror", daemon=True)
        self._thread.start()

    def follow(self, view: ReplicaView, endpoint: str, replay_endpoint: str) -> None:
        self._commands.put(("follow", view, endpoint, replay_endpoint))

    def drop(self, view: ReplicaView) -> None:
        self._commands.put(("drop", view, "", ""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        views: dict[str, ReplicaView] = {}
        poller = zmq.Poller()
        while not self._stop.is_set():
            while not self._commands.empty():
                op, view, endpoint, replay = self._commands.get()
                if op == "follow":
                    subscriber = KVEventSubscriber(endpoint, replay, view.topic)
                    try:
                        subscriber.snapshot()  # a replica's cache as of now, however late we start
                    except Exception as exc:  # it will be retried on the first gap
                        logger.warning("KV snapshot from %s failed: %s", replay, exc)
                    view.mirror = subscriber
                    views[view.replica] = view
                    poller.register(subscriber.socket, zmq.POLLIN)
                elif view.replica in views and views[view.replica].mirror is not None:
                    old = views.pop(view.replica).mirror
                    assert old is not None
                    poller.unregister(old.socket)
                    old.close()
            ready = dict(poller.poll(50)) if views else {}
            if not views:
                time.sleep(0.05)
            for view in list(views.values()):
                if view.mirror is not None and view.mirror.socket in ready:
                    try:
                        view.mirror.poll()
                    except Exception as exc:  # a replica gone mid-replay: its view is dropped soon
                        logger.warning("KV events from %s: %s", view.replica, exc)
        for view in views.values():
            if view.mirror is not None:
                view.mirror.close()


class RoutingTable:
    def __init__(
        self,
        policy: str = "cache-aware",
        index: str = "precise",
        config: RouterConfig | None = None,
        index_capacity: int = 1 << 20,
        seed: int | None = None,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: one of {', '.join(ROUTER_POLICIES)}")
        if index not in ROUTER_INDEXES:
            raise ValueError(f"unknown router index {index!r}: one of {', '.join(ROUTER_INDEXES)}")
        self.policy = policy
        self.index_kind = index
        self.config = config or RouterConfig()
        self.index_capacity = index_capacity
        self.views: dict[str, ReplicaView] = {}
        self.decisions: Counter[str] = Counter()  # why requests went where they went
        self.turn = 0
        self.random = random.Random(seed)
        self._lock = threading.Lock()  # views and counters: the routing loop writes, /router reads
        self._mirrors: MirrorThread | None = None
        self.reports: Callable[[], Reports] = dict  # the router sets it: the replicas' last reported stats
        # Requests counted in flight at decision time, not yet confirmed sent: id -> (replica, when chosen).
        # Counting at decision time is what keeps a burst routed faster than confirmations from piling up.
        self._unconfirmed: dict[str, tuple[str, float]] = {}

    # ---- the replica set --------------------------------------------------------------------------

    def sync(self, replicas: Mapping[str, Mapping[str, Any]]) -> None:
        """The current replicas (id -> metadata): views for new ones, dropped views for gone ones.

        A replica that restarts comes back under a new id: its view starts empty
        (approximate) or from its KV snapshot (precise), never from the old one.
        """
        with self._lock:
            for gone in set(self.views) - set(replicas):
                self._drop(gone)
            for replica, metadata in replicas.items():
                view = self.views.get(replica)
                if view is None:
                    self.views[replica] = self._new_view(replica, metadata)
                elif view.index is not None and self.index_kind == "precise":
                    self._follow(view, metadata)  # its KV-event endpoints may be known only now

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self.views)

    def remove(self, replica: str) -> None:
        with self._lock:
            self._drop(replica)

    def _new_view(self, replica: str, metadata: Mapping[str, Any]) -> ReplicaView:
        view = ReplicaView(replica)
        if self.index_kind != "precise" or not self._follow(view, metadata):
            if self.index_kind == "precise":
                logger.warning("replica %s publishes no KV events (yet): routing on an approximate index", replica)
            view.index = PrefixIndex(self.index_capacity)
        return view

    def _follow(self, view: ReplicaView, metadata: Mapping[str, Any]) -> bool:
        """Mirror the replica's KV events if its metadata says where (a precise view from then on)."""
        endpoint = metadata.get("kv_events_endpoint")
        replay = metadata.get("kv_events_replay_endpoint")
        if not (endpoint and replay):
            return False
        if self._mirrors is None:
            self._mirrors = MirrorThread()
        view.block_size = int(metadata.get("kv_events_block_size", 16))
        view.topic = str(metadata.get("kv_events_topic", ""))
        view.index = None
        self._mirrors.follow(view, str(endpoint), str(replay))
        return True

    def _drop(self, replica: str) -> None:
        view = self.views.pop(replica, None)
        if view is not None and self._mirrors is not None:
            self._mirrors.drop(view)

    def close(self) -> None:
        if self._mirrors is not None:
            self._mirrors.close()
            self._mirrors = None

    # ---- routing ----------------------------------------------------------------------------------

    def load(self, replica: str, reported: Mapping[str, Any] | None) -> int:
        """Requests on a replica: what it last reported (running + waiting) or what this router has in
        flight there, whichever is larger (a report is up to a stats period old)."""
        view = self.views.get(replica)
        mine = len(view.inflight) if view is not None else 0
        theirs = reported.get("requests", 0) if reported else 0
        return max(mine, int(theirs) if isinstance(theirs, (int, float)) else 0)

    def choose(
        self,
        candidates: Sequence[str],
        key: RouteKey | None,
        reported: Reports | None = None,
        request_id: str | None = None,
    ) -> list[list[str]]:
        """Candidates ranked: ``[[pick], [the rest, least loaded first]]`` (``[]``: none fits).

        With a ``request_id`` the request counts in flight on the pick at once (until
        ``routed`` says where it really went, or ``UNCONFIRMED_S`` passes without word).
        """
        if not candidates:
            return []
        if key is not None and key.target is not None:
            return [[key.target]] if key.target in candidates else []
        reported = reported or {}
        with self._lock:
            self._forget_unconfirmed(time.monotonic() - UNCONFIRMED_S)
            for replica in candidates:
                if replica not in self.views:  # routed before sync() heard of it
                    self.views[replica] = self._new_view(replica, {})
            loads = [self.load(r, reported.get(r)) for r in candidates]
            turn = self.turn
            self.turn += 1
            pick, why = self._pick(candidates, key, loads, turn)
            self.decisions[why] += 1
            if request_id is not None and key is not None:
                self._place(request_id, candidates[pick], key)
                self._unconfirmed[request_id] = (candidates[pick], time.monotonic())
        rest = sorted((i for i in range(len(candidates)) if i != pick), key=lambda i: loads[i])
        ranked = [[candidates[pick]]]
        if rest:
            ranked.append([candidates[i] for i in rest])
        return ranked

    def _pick(self, candidates: Sequence[str], key: RouteKey | None, loads: list[int], turn: int) -> tuple[int, str]:
        """The chosen candidate's index, and why (the ``decisions`` counter it adds to)."""
        if self.policy == "round-robin":
            return turn % len(candidates), "round-robin"
        if self.policy == "power-of-two":
            two = self.random.sample(range(len(candidates)), min(2, len(candidates)))
            return min(two, key=lambda i: loads[i]), "power-of-two"
        if key is None or not key.tokens:
            return choose_replica([0] * len(candidates), loads, 1, self.config, turn), "least-loaded"
        matches = [self.views[r].match(key) for r in candidates]
        pick = choose_replica(matches, loads, len(key.tokens), self.config, turn)
        best = max(matches)
        if imbalanced(loads, self.config):
            return pick, "balance"  # load out of balance: the least loaded, whatever it holds
        if best > 0 and matches[pick] == best and best >= self.config.min_match_fraction * len(key.tokens):
            return pick, "prefix"
        return pick, "least-loaded"

    def routed(self, replica: str, request_id: str, key: RouteKey | None) -> None:
        """The request went to ``replica``: count it in flight there and (approximate) index its prompt."""
        with self._lock:
            view = self.views.get(replica)
            if view is None or (key is not None and key.target is not None):
                return  # a pinned call (flush, cache view) is no routing decision
            view.routed += 1
            self._unconfirmed.pop(request_id, None)
            if key is None:
                return
            self._place(request_id, replica, key)
            if view.index is not None and key.tokens:
                view.index.add(key.radix_key())

    def completed(self, replica: str, request_id: str) -> None:
        with self._lock:
            self._unconfirmed.pop(request_id, None)
            view = self.views.get(replica)
            if view is not None:
                view.inflight.pop(request_id, None)

    def _place(self, request_id: str, replica: str, key: RouteKey) -> None:
        """``request_id`` is in flight on ``replica`` (and on no other: a spilled request moves)."""
        for view in self.views.values():
            view.inflight.pop(request_id, None)
        if replica in self.views:
            self.views[replica].inflight[request_id] = key

    def _forget_unconfirmed(self, before: float) -> None:
        """Chosen but never sent (cancelled while waiting): stop counting them."""
        for request_id, (replica, when) in list(self._unconfirmed.items()):
            if when < before:
                del self._unconfirmed[request_id]
                view = self.views.get(replica)
                if view is not None:
                    view.inflight.pop(request_id, None)

    def describe(self) -> dict[str, Any]:
        """The router's state for ``GET /router``: policy, decisions, and per replica what it knows."""
        reported = self.reports()
        with self._lock:
            replicas = []
            for replica, view in sorted(self.views.items()):
                entry: dict[str, Any] = {
                    "replica": replica,
                    "routed": view.routed,
                    "in_flight": len(view.inflight),
                    "load": self.load(replica, reported.get(replica)),
                    "reported": dict(reported.get(replica) or {}),
                }
                if view.index is not None:
                    entry["index"] = {"kind": "approximate", "tokens": view.index.cache.total_size()}
                elif view.mirror is not None:
                    entry["index"] = {
                        "kind": "precise",
                        "blocks": len(view.mirror.blocks),
                        "block_size": view.block_size,
                        "seq": view.mirror.mirror.seq,
                        "snapshots": view.mirror.snapshots,
                        "replays": view.mirror.replays,
                    }
                else:
                    entry["index"] = {"kind": "precise", "blocks": 0, "state": "connecting"}
                replicas.append(entry)
            return {
                "policy": self.policy,
                "index": self.index_kind,
                "abs_threshold": self.config.abs_threshold,
                "rel_threshold": self.config.rel_threshold,
                "decisions": dict(self.decisions),
                "replicas": replicas,
            }


# Every table in this process (a Ray Serve router is unpickled by value, so its own module globals are
# copies: this module is where the front finds the router of its handle).
TABLES: weakref.WeakSet[RoutingTable] = weakref.WeakSet()
