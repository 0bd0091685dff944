"""``/v1/embeddings``: the served model's pooled hidden states, in OpenAI's shape.

    POST /v1/embeddings  {"model": ..., "input": "text" | ["a", "b"] | [1, 2, 3] | [[1, 2], [3]],
                          "encoding_format": "float" | "base64"}
                      -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
                          "model": ..., "usage": {"prompt_tokens", "total_tokens", "prompt_tokens_details"}}

Pooling: the last token's final hidden state (after the model's final norm), L2-normalised: what vLLM does
for decoder-only embedding models (Qwen3-Embedding, e5-mistral). Last-token pooling is what lets the prefix
cache serve embeddings: each input is an ordinary request of the engine (``max_new_tokens=0``,
``return_hidden``), batched by the same scheduler with generation requests; its cached prefix is matched and
never recomputed, its last token always runs (the cache never matches a prompt's last token), and that
token's hidden state comes out of the same forward that writes its K/V. Mean pooling would need every
token's hidden state, which the cache does not keep: a hit would have to recompute the prefix.

``base64`` is the float32 little-endian bytes, as OpenAI's client decodes them. ``dimensions`` other than the
model's hidden size is a 400 (no Matryoshka truncation: this model was not trained for it).
``usage.prompt_tokens_details.cached_tokens`` (an extension) counts the input tokens the cache served.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request, params
from pydantic import BaseModel, ConfigDict, Field

from radixserve.core import GenerateResult
from radixserve.server.errors import APIError, raise_first_error
from radixserve.server.generation import Generation, ServerState, finish_unless_disconnected
from radixserve.server.openai_api import check_model, prompt_batch
from radixserve.server.protocol import MAX_SALT


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT)


def pooled(result: GenerateResult) -> np.ndarray:
    """The request's embedding: its last token's hidden state, L2-normalised (float32)."""
    assert result.hidden_state is not None
    vector = np.asarray(result.hidden_state, dtype=np.float32)
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def embed(state: ServerState, body: EmbeddingRequest, namespace: str | None, request: Request) -> dict[str, Any]:
    check_model(state, body.model)
    hidden_size = state.engine.loaded.config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise APIError(
            400,
            f"dimensions {body.dimensions} is not supported: this model's embeddings have {hidden_size}",
            "unsupported_parameter",
            "dimensions",
        )
    prompts = await prompt_batch(state, body.input, "input")
    params = {"max_new_tokens": 0, "temperature": 0.0}
    requests, arrival = [], time.perf_counter()
    for ids in prompts:
        req = state.make_request(ids, params, False, namespace, arrival)
        req.return_hidden = True
        requests.append(req)
    results = await finish_unless_disconnected(Generation(state, requests), request.is_disconnected)
    raise_first_error(results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    data = [
        {"object": "embedding", "index": i, "embedding": encode(pooled(r), body.encoding_format)}
        for i, r in enumerate(results)
    ]
    return {
        "object": "list",
        "data": data,
        "model": state.args.model_name(),
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
        },
    }


def embeddings_router(state: ServerState, auth: Sequence[params.Depends]) -> APIRouter:
    router = APIRouter(dependencies=auth)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        namespace = state.tenancy.namespace(request.state.tenant, body.cache_salt)
        return await embed(state, body, namespace, request)

    return router
