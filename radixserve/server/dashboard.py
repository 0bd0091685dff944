"""The live dashboard: ``GET /dashboard`` (a page, its script and style) and ``GET /dashboard/data`` (JSON).

The page and its two files are static, inside the package (``server/static/``): no library, nothing
fetched from elsewhere, so it works offline. They need no key (they hold no data); the page polls
``/dashboard/data``, which does, sending ``Authorization: Bearer <key>`` when the user gave one (kept
in the tab's sessionStorage). ``/dashboard/data`` is an ordinary JSON endpoint scripts may poll too:

    GET /dashboard/data?tree=120    counters, load, pool, tiers, evictions, the last requests' timings,
                                    and the 120 hottest radix-tree nodes (tree=0: no tree walk)

What a caller sees follows ``Tenancy.cache_scope``, as ``/cache`` does: under --tenant-isolation a
tenant's tree and timeline hold only its own namespaces; without isolation, with several keys, only
the admin key gets a prefix's text (``head_text``); everyone else gets sizes and shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.params import Depends

from radixserve.server.errors import APIError
from radixserve.server.generation import ServerState

STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
MAX_TREE_NODES = 500


def dashboard_router(state: ServerState, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter()
    engine, tenancy = state.engine, state.tenancy

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return static_file("dashboard.html", "text/html; charset=utf-8")

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no dashboard file {name!r}", "not_found")
        return static_file(name, STATIC_FILES[name])

    @router.get("/dashboard/data", dependencies=list(auth))
    async def data(request: Request, tree: int = Query(0, ge=0, le=MAX_TREE_NODES)) -> dict[str, Any]:
        """The live figures (``engine/live.py`` says what each means) and, with ``tree``, the hottest
        subtrees; a prefix's ``head_text`` only where this caller may read it."""
        scope = tenancy.cache_scope(request.state.tenant)
        view = await state.worker_call(lambda: engine.live_view(tree, scope.visible))
        if view["tree"] is not None:
            decode = (lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False)) if scope.show_text else None
            label_tree(view["tree"]["root"], decode)
        view["model"] = state.args.model_name()
        view["viewer"] = {"text": scope.show_text, "namespaces": "all" if scope.visible is None else "own"}
        return view

    return router


def static_file(name: str, media_type: str) -> Response:
    body = resources.files("radixserve.server").joinpath("static", name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})


def label_tree(node: dict[str, Any], decode: Callable[[list[int]], str] | None) -> None:
    """Each node's head tokens as ``head_text`` (``decode``: the tokenizer's), or dropped (None: hidden)."""
    stack = [node]
    while stack:
        current = stack.pop()
        ids = current.pop("head_token_ids", None)
        if decode is not None and ids is not None:
            current["head_text"] = decode(ids)
        stack.extend(current["children"])
