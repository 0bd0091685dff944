"""Read-only endpoints: health, server and model info (ours, OpenAI's and SGLang's shapes), metrics.

GET /health            liveness (never waits for the model)
GET /server_info       resolved server args + engine config + scheduler counters
GET /v1/models         the served model (OpenAI)
GET /get_model_info    SGLang's shape: model_path, tokenizer_path, is_generation, ...
GET /get_server_info   SGLang's shape: the resolved args flat, scheduler state in internal_states
GET /metrics           Prometheus (with --enable-metrics)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Response
from fastapi.params import Depends
from fastapi.responses import JSONResponse

from radixserve.server.errors import APIError
from radixserve.server.generation import ServerState
from radixserve.server.tools import tool_format

VERSION = "0.1.0"


def info_router(state: ServerState, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter()
    engine, args = state.engine, state.args
    guarded = list(auth)

    @router.get("/health")
    async def health() -> JSONResponse:
        if not state.worker.alive():
            return JSONResponse({"status": "error", "detail": repr(state.worker.failure)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/server_info", dependencies=guarded)
    async def server_info() -> dict[str, Any]:
        return {
            "version": VERSION,
            "server_args": args.resolved(),
            "engine": engine.describe(),
            "scheduler": await state.worker_call(engine.snapshot),
            "cache_tiers": await state.worker_call(engine.tier_stats),
            "process": {"pid": os.getpid(), "rss_bytes": rss_bytes()},
            "tool_calls": tool_format(args.tool_call_parser, state.tokenizer.chat_template),
        }

    @router.get("/v1/models", dependencies=guarded)
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

    @router.get("/metrics")
    async def prometheus() -> Response:
        if state.metrics is None:
            raise APIError(404, "metrics are off: start the server with --enable-metrics", "metrics_disabled")
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def sglang_info_router(state: ServerState, auth: Sequence[Depends]) -> APIRouter:
    """What SGLang's clients read before a run (bench_serving: the model path, the pool size)."""
    router = APIRouter(dependencies=list(auth))
    engine, args = state.engine, state.args

    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        config = engine.loaded.config
        return {
            "model_path": str(engine.loaded.path),
            "served_model_name": args.model_name(),
            "tokenizer_path": str(engine.loaded.path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", "llama"),
            "architectures": getattr(config, "architectures", None) or ["LlamaForCausalLM"],
        }

    @router.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        snapshot = await state.worker_call(engine.snapshot)
        return {
            **args.resolved(),
            "max_total_num_tokens": engine.allocator.size,
            "max_req_input_len": engine.context_length - 1,
            "internal_states": [snapshot],
            "version": VERSION,
            "frontend": "python",
        }

    return router


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where that is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
