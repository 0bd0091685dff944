"""radixserve on Ray Serve: N engine replicas behind one OpenAI front, routed by what each has cached.

    client -> Serve HTTP proxy -> Front (FastAPI; tokenizes the prompt into a RouteKey)
           -> handle(EngineReplica).forward(call, key)   # CacheAwareRouter picks the replica
           -> EngineReplica: the whole single-process server app, driven in-process (ASGIBridge)

Every endpoint therefore behaves as on ``radixserve serve`` without replicas
(same validation, errors, streams, usage with ``cached_tokens``). The front adds:

    GET  /router        the router's policy, decisions and per-replica view (load, index)
    GET  /cache         every replica's /cache, by replica id (so are /server_info and /flush_cache)
    POST /flush_cache   flush every replica
    GET  /metrics       every replica's metrics, each sample labelled with its replica

Each replica publishes its KV events on ``tcp://<node ip>:<free port>`` and says
where in ``record_replica_metadata``; it reports its load (requests in flight)
through ``record_routing_stats``; a dead scheduler fails ``check_health`` and
Serve replaces the replica.
"""

# No ``from __future__ import annotations`` here: Serve's ingress rebuilds the Front's methods,
# and FastAPI must see real annotations (``Request``) on them, not strings.
import asyncio
import concurrent.futures
import contextvars
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import FrameType
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers

from radixserve.model.tokenizer import Tokenizer
from radixserve.router import table as tables  # by module: cloudpickle copies a closure's globals
from radixserve.router.asgi_bridge import ASGIBridge, HTTPCall
from radixserve.router.ray_serve import CacheAwareRouter
from radixserve.router.table import RouteKey, RoutingTable
from radixserve.server.app import build_tenancy, install_error_handlers, open_tracing, shared_heads
from radixserve.server.args import ServerArgs
from radixserve.server.errors import APIError, error_body
from radixserve.server.generation import shared_head_len
from radixserve.server.launch import configure_logging
from radixserve.server.openai_api import SSE_DONE, sse
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.server.sglang_fields import triage
from radixserve.server.tenancy import Tenancy

logger = logging.getLogger("radixserve.replicas")

APP_NAME = "radixserve"
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}


# ---- the engine replica ---------------------------------------------------------------------------


class EngineReplica:
    """One engine and its server app; the front's handle calls ``forward`` with an HTTP call."""

    # Serve awaits an async constructor; mypy wants __init__ to return None.
    async def __init__(self, args: ServerArgs, publish_kv_events: bool = True) -> None:  # type: ignore[misc]
        from radixserve.engine import Engine
        from radixserve.server.app import create_app
        from radixserve.server.launch import off_the_main_thread

        if publish_kv_events:  # any free port on this node's address; the bound one is reported below
            args = dataclasses.replace(
                args,
                kv_events_endpoint=f"tcp://{ray.util.get_node_ip_address()}:*",
                kv_events_replay_endpoint=None,
            )
        # Loaded as `serve` loads it: this thread keeps no OpenMP pool beside the scheduler thread's (launch.py).
        engine = off_the_main_thread(lambda: Engine(args.engine))
        replica = str(serve.get_replica_context().replica_id.to_full_id_str())  # as the router names it
        self.app = create_app(engine, args, replica=replica)
        self.state = self.app.state.radixserve
        self.bridge = ASGIBridge(self.app)
        await self.bridge.startup()

    async def forward(self, call: HTTPCall, key: RouteKey | None = None) -> AsyncIterator[dict[str, Any] | bytes]:
        """The response to ``call``: its head, then its body chunks (``key`` is for the router only)."""
        async for part in self.bridge.request(call):
            yield part

    def record_replica_metadata(self) -> dict[str, Any]:
        events = self.state.worker.events
        if events is None:
            return {"pid": os.getpid()}
        return {
            "pid": os.getpid(),
            "kv_events_endpoint": events.endpoint,
            "kv_events_replay_endpoint": events.replay_endpoint,
            "kv_events_block_size": events.block_size,
            "kv_events_topic": events.topic,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        return {"requests": self.state.worker.in_flight()}

    def check_health(self) -> None:
        if not self.state.worker.alive():
            raise RuntimeError(f"the scheduler thread died: {self.state.worker.failure!r}")

    async def __del__(self) -> None:
        await self.bridge.shutdown()


# ---- the front ------------------------------------------------------------------------------------


def route_key_for(
    path: str, body: bytes, headers: Headers, tokenizer: Tokenizer, tenancy: Tenancy, heads: Sequence[Sequence[int]]
) -> RouteKey | None:
    """The routing key of a generation call: its first prompt's tokens in its cache namespace.

    Exactly what the replica will compute (same schemas, tokenizer, chat template,
    tenancy and shared heads). ``None`` when the call is not a generation or is
    invalid: any replica then answers it (with the same error it would give alone).
    """
    if path not in ROUTED_PATHS:
        return None
    try:
        tenant = tenancy.authenticate(headers)
        ids: list[int]
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate_json(body)
            salt = chat.cache_salt
            ids = tokenizer.apply_chat_template(chat.template_messages())
        elif path == "/v1/completions":
            completion = CompletionRequest.model_validate_json(body)
            salt = completion.cache_salt
            ids = _first_prompt(completion.prompt, tokenizer)
        else:
            native = GenerateRequest.model_validate_json(body)
            if triage(dict(native.model_extra or {}))[1] is not None:
                return None  # a field the replica refuses
            salt = native.extra_key or native.cache_salt
            ids = _first_prompt(native.text if native.text is not None else native.input_ids or [], tokenizer)
    except Exception:  # invalid JSON, schema, auth, template: the replica will say what is wrong
        return None
    namespace = tenancy.namespace(tenant, salt)
    return RouteKey(tuple(ids), namespace, shared_head_len(heads, ids, namespace))


def _first_prompt(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer) -> list[int]:
    first: Any = prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        first = prompt[0]
    return tokenizer.encode(first) if isinstance(first, str) else list(first)


class FrontBase:
    """What the front does; ``make_front`` binds it to routes (Serve's ingress wants an app per class)."""

    def __init__(self, engine: DeploymentHandle, args: ServerArgs) -> None:
        self.engine = engine
        self.args = args
        self.tokenizer = Tokenizer.from_model_path(args.engine.model_path).with_chat_template(args.engine.chat_template)
        self.tenancy = build_tenancy(args)
        self.heads = shared_heads(self.tokenizer, args)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-route-key")
        self.tracing = open_tracing(args)  # the front's route spans; each replica sends its own request spans

    async def describe_router(self, request: Request) -> dict[str, Any]:
        self.tenancy.authenticate(request.headers)
        router = await self.router()
        return router.describe()

    async def merged_metrics(self, request: Request) -> Response:
        """Every replica's metrics in one exposition, each sample labelled with its ``replica``."""
        answers = await self.fan_out(request)
        failed = [(status, data) for status, data in answers.values() if status != 200]
        if failed:  # metrics off (404), or a replica unwell: its own answer says why
            status, data = max(failed)
            return Response(data, status_code=status, media_type="application/json")
        return Response(
            merge_metrics({replica: data.decode() for replica, (_, data) in answers.items()}),
            media_type=CONTENT_TYPE_LATEST,
        )

    async def relay(self, request: Request) -> Response:
        """The call, routed by its key to one replica; that replica's answer streamed back."""
        call = await http_call(request)
        span = None
        if self.tracing is not None:  # the replica's request spans become children of this one
            span, forwarded = self.tracing.route_span(call.path, call.headers)
            call = dataclasses.replace(call, headers=forwarded)
        key = await asyncio.get_running_loop().run_in_executor(
            self.pool, route_key_for, call.path, call.body, request.headers, self.tokenizer, self.tenancy, self.heads
        )
        stream = self.engine.options(stream=True).forward.remote(call, key)
        try:
            head = await stream.__anext__()
        except Exception as exc:  # the replica died or is gone: the client may retry
            stream.cancel()
            logger.warning("no replica answered %s: %s", call.path, exc)
            if self.tracing is not None and span is not None:
                self.tracing.end(span, f"no engine replica answered: {type(exc).__name__}")
            return JSONResponse(
                error_body(503, f"no engine replica answered: {type(exc).__name__}", "replica_unavailable"),
                503,
                {"Retry-After": "1"},
            )
        assert isinstance(head, dict)
        headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        events = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers.items())
        ended = None
        if span is not None:
            span.set_attribute("http.response.status_code", int(head["status"]))
            ended = span.end
        return StreamingResponse(_body(stream, events, ended), status_code=head["status"], headers=headers)

    async def router(self) -> RoutingTable:
        """The routing table of this process's engine handle (made on its first call; wait for replicas)."""
        for _ in range(100):
            routers = [t for t in list(tables.TABLES) if t.views]
            if routers:
                return routers[0]
            if not tables.TABLES:  # the handle builds its router on its first call
                await self.collect(HTTPCall("GET", "/health"), None)
            await asyncio.sleep(0.1)
        raise APIError(503, "no engine replicas yet", "replica_unavailable")

    async def collect(self, call: HTTPCall, key: RouteKey | None) -> tuple[int, bytes]:
        """One extra call of the front's own, answered whole.

        It runs in an empty context: the calls a handler makes otherwise share the
        HTTP request's Serve-internal request id, by which Serve's router pairs a
        routing decision with its pending call, so the calls could wait for each
        other's replica forever.
        """

        async def run() -> tuple[int, bytes]:
            status = 500
            chunks = []
            async for part in self.engine.options(stream=True).forward.remote(call, key):
                if isinstance(part, dict):
                    status = int(part["status"])
                else:
                    chunks.append(part)
            return status, b"".join(chunks)

        return await asyncio.create_task(run(), context=contextvars.Context())

    async def fan_out(self, request: Request) -> dict[str, tuple[int, bytes]]:
        """The call sent to every replica: each one's status and body, by replica id."""
        call = await http_call(request)
        replicas = (await self.router()).replicas()
        answers = await asyncio.gather(*(self.collect(call, RouteKey(target=r)) for r in replicas))
        return dict(zip(replicas, answers))

    async def everywhere(self, request: Request) -> Response:
        """Send the call to every replica; one JSON answer, keyed by replica id (the worst status)."""
        answers = await self.fan_out(request)
        out: dict[str, Any] = {}
        for replica, (status, data) in answers.items():
            try:
                out[replica] = json.loads(data)
            except ValueError:
                out[replica] = {"status": status, "body": data.decode(errors="replace")}
        worst = max((status for status, _ in answers.values()), default=200)
        return JSONResponse({"replicas": out}, status_code=worst)


async def _body(stream: Any, events: bool, ended: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """A replica's streamed body; if the client leaves first, the replica's side is cancelled. If the replica
    dies mid-way, an event stream (``events``) ends with an error event and ``[DONE]``, as a request that failed
    in the engine ends; another body just ends (its status went out with the head). ``ended`` is called last
    (the route span ends)."""
    done = False
    try:
        async for part in stream:
            assert isinstance(part, bytes)
            yield part
        done = True
    except Exception as exc:  # the replica died mid-stream (Ray raises ActorDiedError, RayTaskError, ...)
        done = True  # nothing left to cancel
        logger.warning("an engine replica failed mid-stream: %s", exc)
        if events:
            message = f"the engine replica serving this stream failed: {type(exc).__name__}"
            yield (sse(error_body(503, message, "replica_unavailable")) + SSE_DONE).encode()
    finally:
        if not done:  # the client left: cancel the replica's side (its requests are aborted)
            stream.cancel()
        if ended is not None:
            ended()


def make_front(args: ServerArgs) -> type:
    """The front deployment's class: FrontBase's work behind one FastAPI app's routes."""
    app = FastAPI(title="radixserve", version="0.1.0", description="radixserve replicas behind a cache-aware router.")
    install_error_handlers(app)

    @serve.ingress(app)
    class Front(FrontBase):
        @app.get("/router")
        async def router_state(self, request: Request) -> dict[str, Any]:
            return await self.describe_router(request)

        @app.get("/cache")
        async def cache(self, request: Request) -> Response:
            return await self.everywhere(request)

        @app.post("/flush_cache")
        async def flush_cache(self, request: Request) -> Response:
            return await self.everywhere(request)

        @app.get("/server_info")
        async def server_info(self, request: Request) -> Response:
            return await self.everywhere(request)

        @app.get("/metrics")
        async def metrics(self, request: Request) -> Response:
            return await self.merged_metrics(request)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
        async def forward(self, request: Request) -> Response:
            return await self.relay(request)

    return Front


def merge_metrics(expositions: dict[str, str]) -> str:
    """Prometheus text from each replica -> one exposition; every sample gains a ``replica`` label."""
    families: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))

    class Collected:
        def collect(self) -> list[Metric]:
            return list(families.values())

    return generate_latest(Collected()).decode()  # any object with collect() will do


async def http_call(request: Request) -> HTTPCall:
    client = (request.client.host, request.client.port) if request.client else None
    return HTTPCall(
        request.method,
        request.url.path,
        request.url.query,
        tuple((k.lower(), v) for k, v in request.headers.items()),
        await request.body(),
        client,
    )


# ---- the application and the launcher -------------------------------------------------------------


def build_application(args: ServerArgs, replica_cpus: float = 1.0) -> serve.Application:
    """The front bound to ``args.replicas`` engine replicas under ``args.router``."""
    precise = args.router == "cache-aware" and args.router_index == "precise"
    router = RequestRouterConfig(
        request_router_class=CacheAwareRouter,
        request_router_kwargs={
            "policy": args.router,
            "index": args.router_index,
            "abs_threshold": args.router_abs_threshold,
            "rel_threshold": args.router_rel_threshold,
        },
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    )
    # Serve logs every call at INFO ("CALL forward OK"): only at --log-level debug, as the single server does.
    log_config = {"log_level": args.log_level.upper(), "enable_access_log": args.log_level == "debug"}
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=args.replicas,
        max_ongoing_requests=args.max_queued_requests,
        ray_actor_options={"num_cpus": replica_cpus},
        request_router_config=router,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout,
        health_check_period_s=2.0,
        logging_config=log_config,
    ).bind(args, precise)
    front = serve.deployment(
        make_front(args),
        name="Front",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=args.max_queued_requests,
        logging_config=log_config,
    )
    return front.bind(engine, args)


def serve_replicas(args: ServerArgs) -> None:
    """``radixserve serve --replicas N``: start (or join) Ray, run the app, wait for SIGINT / SIGTERM."""
    configure_logging(args.log_level)
    logger.info("resolved server args: %s", json.dumps(args.resolved(), sort_keys=True))
    own_cluster = args.ray_address is None
    level = logging.getLevelName(args.log_level.upper())
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=level)
    cpus = ray.cluster_resources().get("CPU", 1.0)
    replica_cpus = args.replica_cpus if args.replica_cpus is not None else min(1.0, cpus / args.replicas)
    signals: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        # Only note it: a handler that took a lock (Event.set) could deadlock with the main thread holding it.
        signals.append(sig)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts the drain

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args, replica_cpus), name=APP_NAME, route_prefix="/")
        logger.info(
            "serving %s on http://%s:%d: %d replicas, %s routing (%s index)",
            args.model_name(),
            args.host,
            args.port,
            args.replicas,
            args.router,
            args.router_index,
        )
        while not signals:
            time.sleep(0.2)
        logger.info("shutting down: draining replicas for up to %.0f s", args.graceful_shutdown_timeout)
    finally:
        serve.delete(APP_NAME)
        if own_cluster:
            serve.shutdown()
            ray.shutdown()
    logger.info("server stopped")
