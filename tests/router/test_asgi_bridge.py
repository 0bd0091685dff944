"""ASGIBridge: an ASGI app's lifespan and its HTTP calls, driven in-process as a stream of parts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from radixserve.router.asgi_bridge import ASGIBridge, HTTPCall

T = TypeVar("T")
DEADLINE_S = 5.0  # nothing here should take more than a fraction of this


def run(main: Callable[[], Awaitable[T]]) -> T:
    """One test's coroutine on a fresh loop, never longer than DEADLINE_S."""

    async def bounded() -> T:
        return await asyncio.wait_for(main(), DEADLINE_S)

    return asyncio.run(bounded())


async def collect(bridge: ASGIBridge, call: HTTPCall) -> tuple[dict[str, Any], bytes]:
    """The head and the whole body of one call (asserting the head comes first, once)."""
    parts = [part async for part in bridge.request(call)]
    assert parts and isinstance(parts[0], dict), parts
    assert all(isinstance(p, bytes) for p in parts[1:]), parts
    return parts[0], b"".join(p for p in parts[1:] if isinstance(p, bytes))


class Item(BaseModel):
    name: str
    count: int


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.get("/echo")
    async def echo_get(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "query": dict(request.query_params),
                "x_trace": request.headers.get("x-trace"),
                "client": list(request.client) if request.client else None,
            },
            headers={"X-Reply": "yes"},
        )

    @app.post("/items", status_code=201)
    async def create(item: Item, request: Request) -> dict[str, Any]:
        return {
            "name": item.name,
            "double": 2 * item.count,
            "raw_len": len(await request.body()),
            "auth": request.headers.get("authorization"),
        }

    return app


# ---- lifespan -------------------------------------------------------------------------------------


def test_startup_runs_the_lifespan_and_shutdown_its_teardown() -> None:
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events.append("up")
        yield
        events.append("down")

    app = FastAPI(lifespan=lifespan)

    @app.get("/events")
    async def get_events() -> list[str]:
        return list(events)

    async def main() -> None:
        bridge = ASGIBridge(app)
        await bridge.startup()
        assert events == ["up"]
        head, body = await collect(bridge, HTTPCall("GET", "/events"))
        assert head["status"] == 200 and json.loads(body) == ["up"]  # requests run after startup
        await bridge.shutdown()
        assert events == ["up", "down"]
        assert bridge._lifespan is not None and bridge._lifespan.done()
        await bridge.shutdown()  # a second shutdown is a no-op
        assert events == ["up", "down"]

    run(main)


def test_shutdown_before_startup_is_a_no_op() -> None:
    run(ASGIBridge(FastAPI()).shutdown)


def test_a_failing_lifespan_startup_raises_runtime_error() -> None:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        raise ValueError("no weights here")
        yield

    async def main() -> None:
        bridge = ASGIBridge(FastAPI(lifespan=lifespan))
        with pytest.raises(RuntimeError, match="failed to start") as info:
            await bridge.startup()
        assert "no weights here" in str(info.value)  # the app's own reason reaches the caller
        await bridge.shutdown()  # nothing left to shut down: must not hang

    run(main)


def test_lifespan_state_reaches_requests() -> None:
    # ASGI lifespan spec: the server copies the lifespan scope's "state" into every request's
    # scope, so `yield {...}` in a lifespan shows up as request.state.
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        yield {"pool": "ready"}

    app = FastAPI(lifespan=lifespan)

    @app.get("/pool")
    async def pool(request: Request) -> dict[str, Any]:
        return {"pool": getattr(request.state, "pool", None)}

    async def main() -> None:
        bridge = ASGIBridge(app)
        await bridge.startup()
        _, body = await collect(bridge, HTTPCall("GET", "/pool"))
        await bridge.shutdown()
        assert json.loads(body) == {"pool": "ready"}

    run(main)


# ---- plain calls ----------------------------------------------------------------------------------


def test_get_passes_path_query_headers_and_client_and_returns_the_head_first() -> None:
    call = HTTPCall("GET", "/echo", query="a=1&b=two", headers=(("x-trace", "t-42"),), client=("10.0.0.7", 5123))

    async def main() -> None:
        parts = [part async for part in ASGIBridge(echo_app()).request(call)]
        head, body = parts[0], b"".join(p for p in parts[1:] if isinstance(p, bytes))
        assert isinstance(head, dict) and set(head) == {"status", "headers"}
        assert head["status"] == 200
        assert ("x-reply", "yes") in head["headers"] and ("content-type", "application/json") in head["headers"]
        assert json.loads(body) == {
            "method": "GET",
            "path": "/echo",
            "query": {"a": "1", "b": "two"},
            "x_trace": "t-42",
            "client": ["10.0.0.7", 5123],
        }

    run(main)


def test_post_json_round_trip() -> None:
    payload = json.dumps({"name": "w7", "count": 21}).encode()
    call = HTTPCall(
        "POST", "/items", headers=(("content-type", "application/json"), ("authorization", "Bearer k")), body=payload
    )

    async def main() -> None:
        head, body = await collect(ASGIBridge(echo_app()), call)
        assert head["status"] == 201
        assert json.loads(body) == {"name": "w7", "double": 42, "raw_len": len(payload), "auth": "Bearer k"}

    run(main)


@pytest.mark.parametrize(
    ("call", "status"),
    [
        (HTTPCall("GET", "/nowhere"), 404),
        (HTTPCall("DELETE", "/echo"), 405),
        (HTTPCall("POST", "/items", headers=(("content-type", "application/json"),), body=b'{"name": "x"}'), 422),
        (HTTPCall("POST", "/items", headers=(("content-type", "application/json"),), body=b"{not json"), 422),
    ],
    ids=["404", "405", "422-missing-field", "422-bad-json"],
)
def test_error_statuses_pass_through(call: HTTPCall, status: int) -> None:
    async def main() -> None:
        head, body = await collect(ASGIBridge(echo_app()), call)
        assert head["status"] == status
        assert "detail" in json.loads(body)

    run(main)


def test_an_app_exception_after_its_500_ends_the_stream_cleanly() -> None:
    # Starlette's ServerErrorMiddleware sends a 500 and then re-raises (so servers can log it):
    # the bridge yields that whole 500 response and ends; the caller (the front) relays a clean 500.
    app = FastAPI()

    @app.get("/boom")
    async def boom() -> None:
        raise KeyError("the app broke")

    async def main() -> None:
        parts = [part async for part in ASGIBridge(app).request(HTTPCall("GET", "/boom"))]
        assert isinstance(parts[0], dict) and parts[0]["status"] == 500
        assert b"".join(p for p in parts[1:] if isinstance(p, bytes)) == b"Internal Server Error"

    run(main)


def test_a_handled_exception_is_the_handlers_500() -> None:
    # radixserve installs an `Exception` handler (server/app.py: install_error_handlers); Starlette
    # runs it inside ServerErrorMiddleware, which still re-raises after the JSON 500 is sent.
    app = FastAPI()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": type(exc).__name__}, status_code=500)

    @app.get("/boom")
    async def boom() -> None:
        raise ZeroDivisionError("nope")

    async def main() -> None:
        parts = [part async for part in ASGIBridge(app).request(HTTPCall("GET", "/boom"))]
        assert isinstance(parts[0], dict) and parts[0]["status"] == 500
        assert json.loads(b"".join(p for p in parts[1:] if isinstance(p, bytes))) == {"error": "ZeroDivisionError"}

    run(main)


def test_an_app_that_fails_before_answering_raises_to_the_caller() -> None:
    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("no response at all")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="no response at all"):
            async for _ in ASGIBridge(broken).request(HTTPCall("GET", "/")):
                pass

    run(main)


# ---- streams --------------------------------------------------------------------------------------


def test_stream_chunks_arrive_in_order_as_they_are_sent() -> None:
    app = FastAPI()
    released = [asyncio.Event() for _ in range(4)]

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i, go in enumerate(released):
                yield f"chunk-{i};".encode()
                await go.wait()  # the next chunk only once the caller has this one: no buffering

        return StreamingResponse(chunks(), media_type="text/plain")

    async def main() -> None:
        got: list[bytes] = []
        it = ASGIBridge(app).request(HTTPCall("GET", "/stream"))
        assert isinstance(it, AsyncGenerator)  # closable, as Serve closes it when the client leaves
        head = await asyncio.wait_for(it.__anext__(), 1.0)
        assert isinstance(head, dict) and head["status"] == 200
        for i in range(4):
            chunk = await asyncio.wait_for(it.__anext__(), 1.0)  # would time out if the bridge buffered
            assert chunk == f"chunk-{i};".encode()
            got.append(chunk)
            released[i].set()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(it.__anext__(), 1.0)
        assert got == [f"chunk-{i};".encode() for i in range(4)]

    run(main)


def test_concurrent_streams_do_not_mix() -> None:
    app = FastAPI()

    @app.get("/count/{name}")
    async def count(name: str) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(5):
                yield f"{name}{i}".encode()
                await asyncio.sleep(0)  # let the other stream interleave

        return StreamingResponse(chunks())

    async def main() -> None:
        bridge = ASGIBridge(app)
        (_, a), (_, b) = await asyncio.gather(
            collect(bridge, HTTPCall("GET", "/count/a")), collect(bridge, HTTPCall("GET", "/count/b"))
        )
        assert a == b"a0a1a2a3a4" and b == b"b0b1b2b3b4"

    run(main)


def test_closing_early_tells_the_streaming_app_the_client_left() -> None:
    app = FastAPI()
    seen: list[str] = []
    done = asyncio.Event()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield f"{i};".encode()
                    await asyncio.sleep(0.005)
                seen.append("ran to the end")
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            finally:
                seen.append("finally")
                done.set()

        return StreamingResponse(chunks())

    async def main() -> None:
        it = ASGIBridge(app).request(HTTPCall("GET", "/stream"))
        assert isinstance(it, AsyncGenerator)  # closable, as Serve closes it when the client leaves
        assert isinstance(await it.__anext__(), dict)
        assert await it.__anext__() == b"0;"
        start = time.perf_counter()
        await it.aclose()
        await asyncio.wait_for(done.wait(), 0.5)
        assert time.perf_counter() - start < 0.9  # seen as a disconnect, not the 1 s cancel fallback
        assert seen == ["cancelled", "finally"]

    run(main)


def test_closing_early_cancels_an_app_that_ignores_the_disconnect() -> None:
    # A raw ASGI app that never listens for http.disconnect: the bridge cancels it after its grace.
    seen: list[str] = []

    async def stubborn(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-kind", b"stubborn")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> None:
        it = ASGIBridge(stubborn).request(HTTPCall("GET", "/"))
        assert isinstance(it, AsyncGenerator)  # closable, as Serve closes it when the client leaves
        head = await it.__anext__()
        assert head == {"status": 200, "headers": [("x-kind", "stubborn")]}
        assert await it.__anext__() == b"first"
        start = time.perf_counter()
        await it.aclose()
        assert seen == ["cancelled"]
        assert time.perf_counter() - start < 2.0

    run(main)
