"""The FastAPI app: routes, API-key check, OpenAI-style errors, start-up and shutdown.

GET  /health                 liveness (never waits for the model)
GET  /server_info            resolved server args + engine config + scheduler counters
GET  /v1/models              the served model
POST /v1/completions         OpenAI completions (stream, n, logprobs, echo, stop, seed, cache_salt)
POST /v1/chat/completions    OpenAI chat completions (chat template applied)
POST /generate               native API (text or input_ids, sampling_params, extra_key)
GET  /cache                  what the prefix cache holds: sizes, shape, top shared prefixes
POST /flush_cache            drop every cached prefix (refused while requests are in flight)
GET  /metrics                Prometheus (with --enable-metrics)
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.cache.summary import summarize
from radixserve.engine import Engine
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.args import ServerArgs
from radixserve.server.errors import APIError, error_body
from radixserve.server.generation import ServerState
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import NativeCall
from radixserve.server.openai_api import ChatCall, CompletionCall
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.server.tenancy import ADMIN, Tenancy, key_tenant, read_key_file
from radixserve.server.worker import EngineWorker

logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(engine: Engine, args: ServerArgs) -> FastAPI:
    metrics = ServerMetrics(args.hit_rate_window) if args.enable_metrics else None
    events = None
    if args.kv_events_endpoint:
        events = KVEventPublisher(
            args.kv_events_endpoint,
            args.kv_events_replay_endpoint,
            args.kv_events_block_size,
            args.kv_events_buffer_steps,
            args.kv_events_topic,
            args.kv_events_hwm,
        )
    state = ServerState(
        engine,
        args,
        EngineWorker(engine, metrics, args.max_queued_requests, events),
        metrics,
        build_tenancy(args),
        shared_heads(engine.tokenizer, args),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        logger.info("serving %s on http://%s:%d", args.model_name(), args.host, args.port)
        yield
        logger.info("shutting down: aborting requests still in flight")
        await asyncio.get_running_loop().run_in_executor(None, state.worker.stop)
        state.tokenizer_pool.shutdown(wait=False)
        if events is not None:
            events.close()

    app = FastAPI(
        title="radixserve",
        version="0.1.0",
        lifespan=lifespan,
        description="RadixAttention LLM server: OpenAI-compatible and native APIs.",
    )
    app.state.radixserve = state
    install_error_handlers(app)
    app.add_middleware(JSONBodyMiddleware)

    tenancy = state.tenancy

    async def identify(request: Request) -> str | None:
        """The caller's tenant (see tenancy.py); 401 when the key or the tenant header is wrong."""
        tenant = tenancy.authenticate(request.headers)
        request.state.tenant = tenant
        return tenant

    auth = [Depends(identify)]

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.worker.alive():
            return JSONResponse({"status": "error", "detail": repr(state.worker.failure)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/server_info", dependencies=auth)
    async def server_info() -> dict[str, Any]:
        scheduler = await asyncio.wrap_future(state.worker.call(engine.scheduler.snapshot))
        return {
            "version": app.version,
            "server_args": args.resolved(),
            "engine": engine.describe(),
            "scheduler": scheduler,
            "process": {"pid": os.getpid(), "rss_bytes": rss_bytes()},
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        card = {
            "id": args.model_name(),
            "object": "model",
            "created": int(state.started),
            "owned_by": "radixserve",
            "root": str(engine.loaded.path),
            "max_model_len": engine.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(
            CompletionCall(state, body, tenancy.namespace(request.state.tenant, body.cache_salt)), body.stream, request
        )

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(
            ChatCall(state, body, tenancy.namespace(request.state.tenant, body.cache_salt)), body.stream, request
        )

    @app.post("/generate", dependencies=auth)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await respond(
            NativeCall(state, body, tenancy.namespace(request.state.tenant, body.extra_key)), body.stream, request
        )

    @app.get("/cache", dependencies=auth)
    async def cache(request: Request, top: int = Query(10, ge=0, le=100), check: bool = False) -> dict[str, Any]:
        """Sizes (tokens), shape, and the most shared prefixes (their first and last tokens as text).

        ``live_request_tokens`` are slots held privately by running requests:
        free + cached + live == pool, always. ``check=true`` also verifies every
        cache invariant (walks the whole tree). Under --tenant-isolation a tenant
        sees only its own namespaces (no pool-wide figures); the admin key sees all.
        """
        tenant = request.state.tenant
        if tenancy.isolation and tenant != ADMIN:
            own = tenancy.namespace(tenant, None) or ""
            view = await asyncio.wrap_future(
                state.worker.call(
                    lambda: summarize(engine.cache, top, visible=lambda ns: ns is not None and ns.startswith(own))
                )
            )
            return decode_previews(engine, view)

        def snapshot() -> dict[str, Any]:
            out = summarize(engine.cache, top)
            out["live_request_tokens"] = out["pool_tokens"] - out["free_tokens"] - out["cached_tokens"]
            out["running_requests"] = len(engine.scheduler.running)
            out["waiting_requests"] = len(engine.scheduler.waiting)
            if check:
                try:
                    engine.cache.check_invariants()
                    out["invariants"] = "ok"
                except AssertionError as exc:
                    out["invariants"] = f"broken: {exc}"
            return out

        return decode_previews(engine, await asyncio.wrap_future(state.worker.call(snapshot)))

    @app.post("/flush_cache", dependencies=auth)
    async def flush_cache(request: Request) -> dict[str, Any]:
        if tenancy.isolation and request.state.tenant != ADMIN:
            raise APIError(403, "under --tenant-isolation only the admin key may flush the cache", "forbidden")

        def flush() -> int:
            if engine.scheduler.has_work():
                raise APIError(400, "cache not flushed: requests are in flight", "requests_in_flight")
            dropped = engine.cache.total_size()
            engine.cache.reset()
            return dropped

        dropped = await asyncio.wrap_future(state.worker.call(flush))
        return {"flushed": True, "dropped_tokens": dropped}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are off: start the server with --enable-metrics", "metrics_disabled")
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class JSONBodyMiddleware:
    """Read every POST body as JSON, whatever its Content-Type says.

    ``curl -d '{...}'`` sends ``application/x-www-form-urlencoded``; FastAPI would
    then parse a form and reject the body. Every POST endpoint here takes JSON.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


async def respond(call: CompletionCall | ChatCall | NativeCall, stream: bool, request: Request) -> Response:
    """Start the call's requests; an SSE stream, or the whole answer (aborted if the client leaves)."""
    generation = await call.begin()
    if stream:
        return StreamingResponse(call.stream(generation), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await call.run(generation, request.is_disconnected))


def decode_previews(engine: Engine, out: dict[str, Any]) -> dict[str, Any]:
    """The shared prefixes' first and last tokens, as text."""
    for prefix in out.get("top_shared_prefixes", []):
        prefix["head_text"] = engine.tokenizer.decode(prefix.pop("head_token_ids"), skip_special_tokens=False)
        prefix["tail_text"] = engine.tokenizer.decode(prefix.pop("tail_token_ids"), skip_special_tokens=False)
    return out


def shared_heads(tokenizer: Tokenizer, args: ServerArgs) -> list[list[int]]:
    """The allowlisted public prompt heads as token ids, longest first."""
    heads = [tokenizer.encode(text) for text in args.shared_prefixes]
    heads += [
        tokenizer.apply_chat_template([{"role": "system", "content": text}], add_generation_prompt=False)
        for text in args.shared_system_prompts
    ]
    for head in heads:
        logger.info("shared prompt head: %d tokens", len(head))
    return sorted((h for h in heads if h), key=len, reverse=True)


def build_tenancy(args: ServerArgs) -> Tenancy:
    keys = {key: key_tenant(key) for key in args.api_keys}
    if args.api_key_file:
        keys.update(read_key_file(args.api_key_file))
    return Tenancy(keys, args.admin_api_key, args.tenant_header, args.tenant_isolation)


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where that is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON (UTF-8): {first.get('ctx', {}).get('error', '')}".strip()
        else:
            message = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}" for e in errors[:5]
            )
        return JSONResponse(error_body(400, message, "invalid_request", where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:  # FastAPI's words for undecodable bytes
            message = "the request body is not valid JSON (UTF-8): it could not be decoded"
        return JSONResponse(
            error_body(exc.status_code, message), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)
