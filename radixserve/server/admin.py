"""The cache's admin endpoints: ``GET /cache`` (what it holds) and ``POST /flush_cache`` (drop it all).

Who may do what (``Tenancy.is_operator``): the admin key always; without an admin key and
with a single identity (no key, or one ``--api-key``), that one caller. With several
identities (several keys, a key file, a tenant header) the cache is shared between
people who must not read each other's prompts: ``/cache`` then shows sizes and shape but
no prompt text (``head_text`` / ``tail_text``) to a non-admin, and ``/flush_cache`` is
403. Under ``--tenant-isolation`` a tenant's ``/cache`` shows only its own namespaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends

from radixserve.engine import Engine
from radixserve.engine.driver import RequestsInFlight
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
        tenant = request.state.tenant
        if tenancy.isolation and not tenancy.is_operator(tenant):
            own = tenancy.namespace(tenant, None) or ""
            view = await state.worker_call(
                lambda: engine.cache_view(top, visible=lambda ns: ns is not None and ns.startswith(own))
            )
            return decode_previews(engine, view)
        out = await state.worker_call(lambda: engine.cache_view(top, check))
        if tenancy.is_operator(tenant):
            return decode_previews(engine, out)
        return hide_previews(out)

    @router.post("/flush_cache")
    async def flush_cache(request: Request) -> dict[str, Any]:
        if not tenancy.is_operator(request.state.tenant):
            raise APIError(403, "with several API keys or tenants only the admin key may flush the cache", "forbidden")
        try:  # the engine's own flush: the pool and the host tier
            dropped = await state.worker_call(engine.flush_cache)
        except RequestsInFlight as exc:
            raise APIError(400, str(exc), "requests_in_flight") from None
        return {"flushed": True, "dropped_tokens": dropped}

    return router


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
