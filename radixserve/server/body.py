"""The outermost layer of every request: body size, JSON sanity, and no exception that drops a connection.

``BodyGuard`` reads each POST body before any route sees it:

- a ``Content-Length`` over ``--max-request-bytes`` is a 413 before a byte is read, and a
  chunked body is cut off (413) as soon as it grows past the limit;
- a body that is not UTF-8 JSON, a number with more than ``MAX_INT_DIGITS``
  digits, nesting deeper than ``MAX_DEPTH``, and a lone UTF-16 surrogate in any string
  (``"\\ud800"``: valid JSON, but no tokenizer or encoder takes it) are each a 400 naming the
  problem and the field;
- whatever the Content-Type says, the body is read as JSON (``curl -d`` sends a form type).

It also catches any exception a route lets escape: the client gets an OpenAI-shaped 500 and
the keep-alive connection stays open (an exception that reaches uvicorn closes it, and a
request pipelined behind it would get no answer).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import error_body

logger = logging.getLogger(__name__)

MAX_DEPTH = 32  # no request schema nests deeper than ~5
MAX_INT_DIGITS = 40  # beyond any uint128; Python would parse 4,300 digits
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # where a lone surrogate may hide in raw JSON
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyError(400, f"a number in the request has {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def check_json_body(raw: bytes) -> Any:
    """The parsed body (None when empty: POST /flush_cache takes none); BodyError (400) says what is wrong."""
    if not raw.strip():
        return None  # a route that needs a body says so (the app's validation handler)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(
            400, f"the request body is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        body = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise BodyError(400, f"the request body is not valid JSON: {exc}") from None
    where = _too_deep(body)
    if where is not None:
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels", where or None)
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk every string
        where = _lone_surrogate(body)
        if where is not None:
            raise BodyError(400, f"{where or 'body'}: a string holds a lone UTF-16 surrogate (not text)", where)
    return body


def _children(value: Any, path: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()] + [(path, k) for k in value]
    if isinstance(value, list):
        return [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    return []


def _too_deep(body: Any) -> str | None:
    """The path of a value nested deeper than MAX_DEPTH, or None (iterative: no recursion limit)."""
    stack = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return path
        stack.extend((child, where, depth + 1) for where, child in _children(value, path))
    return None


def _lone_surrogate(body: Any) -> str | None:
    """The path of the first string (value or key) holding a lone surrogate, or None."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            return path
        stack.extend((child, where) for where, child in _children(value, path))
    return None


class BodyGuard:
    """ASGI middleware: see the module docstring. ``max_bytes`` is ``--max-request-bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if scope["method"] == "POST":
                raw = await self._read(scope, receive)
                if check_json_body(raw) is None:
                    raw = b""  # whitespace alone is no body either
                scope, receive = _with_json_body(scope, raw, receive)
            await self.app(scope, receive, tracked_send)
        except BodyError as exc:
            await _send_json(send, exc.status, error_body(exc.status, exc.message, None, exc.param))
        except Exception as exc:
            if started:  # a stream already under way: nothing can be said on it
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            await _send_json(send, 500, error_body(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyError(413, f"the request body has {int(declared)} bytes (at most {limit}: --max-request-bytes)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BodyError(400, "the client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _with_json_body(scope: Scope, raw: bytes, upstream: Receive) -> tuple[Scope, Receive]:
    """The scope with a JSON Content-Type, and a receive that hands the app the body already read."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await upstream()  # later messages: the client's disconnect, which handlers poll for

    return scope, receive


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
