"""The FastAPI app: routes, API-key check, OpenAI-style errors, start-up and shutdown.

GET  /health, /server_info, /v1/models, /get_model_info, /get_server_info, /metrics   (info.py)
POST /v1/completions         OpenAI completions (stream, n, logprobs, echo, stop, seed, cache_salt)
POST /v1/chat/completions    OpenAI chat completions (chat template applied)
POST /generate               native API, SGLang's request fields (text or input_ids, sampling_params, ...)
GET  /cache, POST /flush_cache   the prefix cache, admin-only with several tenants (admin.py)
GET  /dashboard, /dashboard/data   the live dashboard page and the JSON it polls (dashboard.py)

Every POST body passes ``BodyGuard`` first (size limit, JSON sanity; body.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request, params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.engine import Engine
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.model.tokenizer import Tokenizer
from radixserve.server.admin import admin_router
from radixserve.server.args import ServerArgs
from radixserve.server.body import BodyGuard
from radixserve.server.dashboard import dashboard_router
from radixserve.server.embeddings import embeddings_router
from radixserve.server.errors import APIError, error_body
from radixserve.server.generation import CALL_HEADERS, ServerState
from radixserve.server.info import VERSION, info_router, sglang_info_router
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_api import NativeCall
from radixserve.server.openai_api import ChatCall, CompletionCall
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.server.tenancy import Tenancy, key_tenant, read_key_file
from radixserve.server.tier_metrics import TierCollector
from radixserve.server.tokenize_api import tokenize_router
from radixserve.server.worker import EngineWorker

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from radixserve.server.tracing import RequestTracer, Tracing

logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def open_kv_events(args: ServerArgs) -> KVEventPublisher | None:
    """The KV events publisher ``args`` ask for, its sockets bound (None: events off). KVEventsBindError if an
    endpoint cannot be bound: ``serve`` opens it before the model loads, so that fails at once."""
    if not args.kv_events_endpoint:
        return None
    return KVEventPublisher(
        args.kv_events_endpoint,
        args.kv_events_replay_endpoint,
        args.kv_events_block_size,
        args.kv_events_buffer_steps,
        args.kv_events_topic,
        args.kv_events_hwm,
    )


def open_tracing(args: ServerArgs) -> Tracing | None:
    """Spans to ``--otlp-traces-endpoint`` (None: off, and OpenTelemetry is never imported)."""
    if not args.otlp_traces_endpoint:
        return None
    from radixserve.server.tracing import Tracing

    return Tracing.to_endpoint(args.otlp_traces_endpoint)


def open_tracer(engine: Engine, args: ServerArgs, replica: str | None) -> RequestTracer | None:
    """Request traces (see tracing.py), each request span labelled with the policies and ``replica``."""
    tracing = open_tracing(args)
    if tracing is None:
        return None
    from radixserve.server.tracing import RequestTracer

    attributes = {f"radixserve.{name}": value for name, value in cache_config_labels(engine).items()}
    if replica is not None:
        attributes["radixserve.replica"] = replica
    return RequestTracer(tracing, attributes)


def create_app(
    engine: Engine, args: ServerArgs, events: KVEventPublisher | None = None, replica: str | None = None
) -> FastAPI:
    """The app serving ``engine``; ``events``: the publisher ``open_kv_events(args)`` opened (None: open it here);
    ``replica``: its name under ``--replicas`` (its request spans carry it)."""
    if args.kv_events_endpoint and not engine.config.enable_kv_events:  # it would publish nothing, silently
        raise ValueError("--kv-events-endpoint needs an engine with enable_kv_events: build it from args.engine")
    kv_tokens_per_gib = engine.kv_tokens_per_gib()
    metrics = (
        ServerMetrics(args.hit_rate_window, cache_config_labels(engine), kv_tokens_per_gib)
        if args.enable_metrics
        else None
    )
    if metrics is not None and engine.tiers is not None:
        metrics.registry.register(TierCollector(engine.tiers))
    if events is None:
        events = open_kv_events(args)
    if events is not None:
        events.describe_kv(cache_config_labels(engine)["kv_cache_dtype"], kv_tokens_per_gib)
    tracer = open_tracer(engine, args, replica)
    worker = EngineWorker(engine, metrics, args.max_queued_requests, events, args.graceful_shutdown_timeout, tracer)
    state = ServerState(engine, args, worker, metrics, build_tenancy(args), shared_heads(engine.tokenizer, args))
    state.tracer = tracer
    closers = [c.close for c in (events, tracer) if c is not None]

    def close() -> None:  # after the worker stopped: the last spans and KV events go out
        for closer in closers:
            closer()

    app = FastAPI(
        title="radixserve",
        version=VERSION,
        lifespan=lifespan(state, close),
        description="RadixAttention LLM server: OpenAI-compatible and native APIs.",
    )
    app.state.radixserve = state
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=args.max_request_bytes)
    auth = [Depends(identify(state.tenancy))]
    app.include_router(info_router(state, auth))
    app.include_router(sglang_info_router(state, auth))
    app.include_router(generation_router(state, auth))
    app.include_router(admin_router(state, auth))
    app.include_router(dashboard_router(state, auth))
    app.include_router(tokenize_router(state, auth))
    app.include_router(embeddings_router(state, auth))
    return app


def cache_config_labels(engine: Engine) -> dict[str, str]:
    """The labels of ``radixserve:cache_config_info``: how the prefix cache and the scheduler are set up."""
    config = engine.config
    return {
        "prefix_cache": config.prefix_cache,
        "eviction_policy": config.radix_eviction_policy,
        "schedule_policy": config.schedule_policy,
        "page_size": str(config.page_size),
        "kv_cache_dtype": str(engine.kv_pool.dtype).removeprefix("torch."),
    }


def lifespan(
    state: ServerState, on_close: Callable[[], None] | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        args = state.args
        logger.info("serving %s on http://%s:%d", args.model_name(), args.host, args.port)
        yield
        logger.info("shutting down: aborting requests still in flight")
        await asyncio.get_running_loop().run_in_executor(None, state.worker.stop)
        state.shutdown_tokenizers()
        if on_close is not None:
            on_close()

    return run


def identify(tenancy: Tenancy) -> Callable[[Request], object]:
    async def check(request: Request) -> str | None:
        """The caller's tenant (see tenancy.py); 401 when the key or the tenant header is wrong."""
        tenant = tenancy.authenticate(request.headers)
        request.state.tenant = tenant
        return tenant

    return check


def generation_router(state: ServerState, auth: Sequence[params.Depends]) -> APIRouter:
    router = APIRouter(dependencies=auth)
    tenancy = state.tenancy

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        namespace = tenancy.namespace(request.state.tenant, body.cache_salt)
        return await respond(CompletionCall(state, body, namespace), body.stream, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        namespace = tenancy.namespace(request.state.tenant, body.cache_salt)
        return await respond(ChatCall(state, body, namespace), body.stream, request)

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if body.extra_key is not None and body.cache_salt is not None and body.extra_key != body.cache_salt:
            raise APIError(400, "give one of extra_key and cache_salt (they name the same thing)", param="cache_salt")
        namespace = tenancy.namespace(request.state.tenant, body.extra_key or body.cache_salt)
        return await respond(NativeCall(state, body, namespace), body.stream, request)

    return router


async def respond(call: CompletionCall | ChatCall | NativeCall, stream: bool, request: Request) -> Response:
    """Start the call's requests; an SSE stream, or the whole answer (aborted if the client leaves)."""
    CALL_HEADERS.set(request.headers)  # a traced request's parent (this task's own copy)
    generation = await call.begin()
    if stream:
        return StreamingResponse(call.stream(generation), media_type="text/event-stream", headers=SSE_HEADERS)
    body = await call.run(generation, request.is_disconnected)
    return Response(await asyncio.to_thread(json_bytes, body), media_type="application/json")


def json_bytes(body: Any) -> bytes:
    """``body`` as JSONResponse renders it, a list's items (a batch, or an answer's choices) encoded one call each:
    json's C encoder holds the GIL for a whole call, so a 100 MB answer in one call stalled the event loop (and
    ``/health``) while a worker thread encoded it; between items the loop runs."""
    if isinstance(body, list):
        return b"[" + b",".join(json_bytes(item) for item in body) + b"]"
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) < 2:
        return bytes(JSONResponse(body).body)
    marker = f"choices-{uuid.uuid4().hex}"
    head = bytes(JSONResponse({**body, "choices": marker}).body)
    return head.replace(json.dumps(marker).encode(), json_bytes(choices), 1)


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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = field_path(first.get("loc", ()))
        if first.get("type") == "missing" and field_path(first.get("loc", ())) == "":
            message = "the request body is empty: send a JSON object"
        elif first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON (UTF-8): {first.get('ctx', {}).get('error', '')}".strip()
        else:
            message = "; ".join(f"{field_path(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
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
        """Apps without BodyGuard (the scale-out front): still an OpenAI-shaped 500."""
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)


def field_path(loc: Sequence[object]) -> str:
    """pydantic's error location as the field's dotted path (``sampling_params.stop``)."""
    return ".".join(str(part) for part in loc if part != "body")
