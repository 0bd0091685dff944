"""The cache's admin endpoints: ``GET /cache`` (what it holds) and ``POST /flush_cache`` (drop it all: the
KV pool, the host tier and the disk tier, or the ``tiers`` named).

Who may do what (``Tenancy.is_operator``): the admin key always; without an admin key and
with a single identity (no key, or one ``--api-key``), that one caller. With several
identities (several keys, a key file, a tenant header) the cache is shared between
people who must not read each other's prompts: ``/cache`` then shows sizes and shape but
no prompt text (``head_text`` / ``tail_text``) to a non-admin, and ``/flush_cache`` is
403. Under ``--tenant-isolation`` a tenant's ``/cache`` shows only its own namespaces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends

from radixserve.engine import Engine
from radixserve.engine.driver import CACHE_TIERS, RequestsInFlight, check_flush_tiers
from radixserve.server.errors import APIError
from radixserve.server.generation import ServerState

PREVIEW_FIELDS = ("head_token_ids", "tail_token_ids")


def admin_router(state: ServerState, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(dependencies=list(auth))
    engine, tenancy = state.engine, state.tenancy

    @router.get("/cache")
    async def cache(request: Request, top: int = Query(10, ge=0, le=100), check: bool = False) -> dict[str, Any]:
        """Sizes (tokens), shape, and the most shared prefixes (their first and last tokens as text).

        ``Engine.cache_view`` says what each figure means; ``check=true`` also verifies every
        cache invariant (walks the whole tree). Under --tenant-isolation a tenant
        sees only its own namespaces (no pool-wide figures); the admin key sees all.
        With several identities and no isolation, only the admin sees prompt text.
        """
        scope = tenancy.cache_scope(request.state.tenant)
        if scope.visible is not None:
            view = await state.worker_call(lambda: engine.cache_view(top, visible=scope.visible))
        else:
            view = await state.worker_call(lambda: engine.cache_view(top, check))
        return decode_previews(engine, view) if scope.show_text else hide_previews(view)

    @router.post("/flush_cache")
    async def flush_cache(request: Request, tiers: str | None = None) -> dict[str, Any]:
        """Drop every cached prefix from the KV pool, the host tier and the disk tier (``tiers``: some of them).

        ``tiers`` comes as a query parameter (``?tiers=device,host``) or a JSON body field
        (``{"tiers": ["device", "host"]}``); absent, all three. 400 for an unknown tier
        or while requests are in flight (nothing is dropped then).
        """
        if not tenancy.is_operator(request.state.tenant):
            raise APIError(403, "with several API keys or tenants only the admin key may flush the cache", "forbidden")
        chosen = flush_tiers(tiers, await request.body())
        try:  # the engine's own flush; the disk's files are deleted by its writer thread
            dropped = await state.worker_call(lambda: engine.flush_cache(chosen))
        except RequestsInFlight as exc:
            raise APIError(400, str(exc), "requests_in_flight") from None
        return {"flushed": True, "tiers": list(chosen), "dropped_tokens": dropped}

    return router


def flush_tiers(query: str | None, raw: bytes) -> tuple[str, ...]:
    """The tiers a flush names: the query's comma-separated list, else the body's ``tiers`` list, else all;
    APIError(400) for anything else (BodyGuard already checked that a body is JSON)."""
    body = json.loads(raw) if raw.strip() else None
    field = body.get("tiers") if isinstance(body, dict) else None
    if body is not None and (not isinstance(body, dict) or set(body) - {"tiers"}):
        raise APIError(400, 'the body of /flush_cache may only hold "tiers"', "invalid_tiers")
    if query is not None and field is not None:
        raise APIError(400, "name the tiers in the query or in the body, not both", "invalid_tiers", "tiers")
    if query is not None:
        field = [t.strip() for t in query.split(",") if t.strip()]
    if field is None:
        return CACHE_TIERS
    if not isinstance(field, list) or not all(isinstance(t, str) for t in field):
        raise APIError(400, "tiers must be a list of tier names", "invalid_tiers", "tiers")
    try:
        return check_flush_tiers(field)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_tiers", "tiers") from None


def decode_previews(engine: Engine, out: dict[str, Any]) -> dict[str, Any]:
    """The shared prefixes' first and last tokens, as text."""
    for prefix in out.get("top_shared_prefixes", []):
        prefix["head_text"] = engine.tokenizer.decode(prefix.pop("head_token_ids"), skip_special_tokens=False)
        prefix["tail_text"] = engine.tokenizer.decode(prefix.pop("tail_token_ids"), skip_special_tokens=False)
    return out


def hide_previews(out: dict[str, Any]) -> dict[str, Any]:
    """The shared prefixes without their tokens: another tenant's prompt is not ours to show."""
    for prefix in out.get("top_shared_prefixes", []):
        for name in PREVIEW_FIELDS:
            prefix.pop(name, None)
    return out
