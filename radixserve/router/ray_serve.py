"""The cache-aware request router for Ray Serve (``ray.serve.request_router.RequestRouter``).

Configured on the engine deployment through ``RequestRouterConfig`` (see
``deployments.py``); Ray Serve builds one in every process that holds a handle
to that deployment and calls:

- ``update_replicas`` when the replica set changes: the table gets a view per
  replica (a precise one follows the replica's KV events, whose endpoints the
  replica reports once, in ``record_replica_metadata``);
- ``choose_replicas`` per request: ranked candidates from ``RoutingTable.choose``,
  with the loads the replicas report through ``record_routing_stats``;
- ``on_request_routed`` / ``on_request_completed``: in-flight counts and the
  approximate index.

The request's ``RouteKey`` is the second positional argument of the handle call.
Every router's table is listed in ``table.TABLES``, so the front's ``/router``
endpoint can show what it knows and ``/flush_cache`` can reach each replica.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from radixserve.router import table as tables  # by module: Serve pickles this module by value
from radixserve.router.choice import RouterConfig
from radixserve.router.table import RouteKey, RoutingTable


def route_key(pending_request: PendingRequest | None) -> RouteKey | None:
    if pending_request is None:
        return None
    args = pending_request.args
    return args[1] if len(args) > 1 and isinstance(args[1], RouteKey) else None


def replica_name(replica_id: ReplicaID) -> str:
    return str(replica_id.to_full_id_str())


class CacheAwareRouter(RequestRouter):  # type: ignore[misc]  # Ray ships no type information
    """Longest cached prefix unless load is out of balance (or round-robin / power-of-two, to compare)."""

    table: RoutingTable

    def initialize_state(
        self,
        policy: str = "cache-aware",
        index: str = "precise",
        abs_threshold: int = 8,
        rel_threshold: float = 1.5,
        min_match_fraction: float = 0.1,
        index_capacity: int = 1 << 20,
    ) -> None:
        config = RouterConfig(abs_threshold, rel_threshold, min_match_fraction)
        self.table = RoutingTable(policy, index, config, index_capacity)
        self.table.reports = self.reported
        tables.TABLES.add(self.table)

    def reported(self) -> dict[str, dict[str, Any]]:
        """Each replica's last ``record_routing_stats``."""
        return {replica_name(rid): dict(r.routing_stats or {}) for rid, r in list(self.curr_replicas.items())}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.sync({replica_name(r.replica_id): r.replica_metadata for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.remove(replica_name(replica_id))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {replica_name(r.replica_id): r for r in candidate_replicas}
        reported = {name: dict(r.routing_stats or {}) for name, r in by_name.items()}
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        ranked = self.table.choose(list(by_name), route_key(pending_request), reported, request_id)
        return [[by_name[name] for name in rank] for rank in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.table.routed(replica_name(replica_id), request_id, route_key(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.table.completed(replica_name(replica_id), internal_request_id)
