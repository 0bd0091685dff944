"""Run an ASGI app in-process: its lifespan, and one HTTP request at a time as a stream of parts.

An engine replica hosts the whole single-process server app (every endpoint,
error and stream exactly as ``radixserve serve`` has them) and the front calls
it through a Ray Serve handle, not over HTTP. ``ASGIBridge.request`` yields the
response head (``{"status", "headers"}``) and then the body chunks as the app
sends them; closing the iterator early (the client left) tells the app the
client disconnected and cancels it, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class HTTPCall:
    """One HTTP request as the front received it (headers lower-cased)."""

    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


class ASGIBridge:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._lifespan: asyncio.Task[None] | None = None
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()
        self._state: dict[str, Any] = {}  # what the lifespan yields; each request gets a copy (ASGI spec)

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self._state}
        self._lifespan = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        reply = await self._from_app.get()
        if reply["type"] != "lifespan.startup.complete":
            with contextlib.suppress(Exception):
                await self._lifespan  # collect its exception: the message below says it
            raise RuntimeError(f"the app failed to start: {reply.get('message', reply['type'])}")

    async def shutdown(self) -> None:
        if self._lifespan is None or self._lifespan.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._from_app.get()
        await self._lifespan

    async def request(self, call: HTTPCall) -> AsyncIterator[dict[str, Any] | bytes]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},  # < 2.4: Starlette listens for the disconnect
            "http_version": "1.1",
            "method": call.method,
            "scheme": "http",
            "path": call.path,
            "raw_path": call.path.encode(),
            "query_string": call.query.encode(),
            "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in call.headers],
            "client": call.client,
            "server": None,
            "state": dict(self._state),
        }
        body_sent = False
        gone = asyncio.Event()
        out: asyncio.Queue[Message | None] = asyncio.Queue()

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await out.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        complete = False
        try:
            while (message := await out.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": _decode(message.get("headers", ()))}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        complete = True
                        break
            failure = task.exception() if not complete and task.done() else None
            if failure is not None:
                raise failure  # no (whole) response: the caller must know
        finally:
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 1.0)  # let it see the disconnect
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # an error after a whole response (Starlette re-raises past its 500) was logged there


def _decode(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
