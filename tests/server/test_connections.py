"""Bounds on what a client can hold (issue 37, item 5): a request head has a deadline, heads have a size cap, and
open connections a cap. Each against a real uvicorn server in a thread, with the protocol ``serve`` uses, on a
trivial app (the bounds are the HTTP layer's, not the engine's)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from radixserve.server.args import parse_args
from radixserve.server.connections import uvicorn_limits

DEADLINE_S = 60.0  # generous: a busy CI box; the bounds under test are a second or two


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    header_timeout, max_connections = request.param
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    limits = uvicorn_limits(header_timeout, max_connections, 4096, 1.0)
    config = uvicorn.Config(app, log_config=None, lifespan="off", **limits)
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + DEADLINE_S
    while not served.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield url
    served.should_exit = True
    thread.join(DEADLINE_S)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
    return conn


def closed_by_server(conn: socket.socket) -> bool:
    """True once the server closed ``conn`` (recv returns b"" or the connection resets), within DEADLINE_S."""
    try:
        while chunk := conn.recv(4096):
            if not chunk:
                break
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("server", [(1.0, 0)], indirect=True)
def test_idle_and_slow_head_connections_are_closed(server: str) -> None:
    """A connection that sends nothing, and one that sends its head a byte at a time, are closed after the head
    deadline (they stayed open for ever); a normal request on the same server still answers."""
    idle, slow = connect(server), connect(server)
    slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
    started = time.monotonic()
    assert closed_by_server(idle) and closed_by_server(slow)
    assert time.monotonic() - started < DEADLINE_S
    assert httpx.get(server + "/", timeout=DEADLINE_S).text == "ok"


@pytest.mark.parametrize("server", [(30.0, 0)], indirect=True)
def test_an_oversized_head_is_refused(server: str) -> None:
    """A head past --max-header-bytes (4 KiB here) gets a 400 and the connection closes; the server serves on."""
    response = httpx.get(server + "/", headers={"x-big": "a" * 100_000}, timeout=DEADLINE_S)
    assert response.status_code == 400
    assert httpx.get(server + "/", timeout=DEADLINE_S).text == "ok"


@pytest.mark.parametrize("server", [(2 * DEADLINE_S, 3)], indirect=True)
def test_connections_past_the_cap_are_closed_at_once(server: str) -> None:
    """With --max-connections 3 and three idle connections open, a fourth is closed (the head deadline is the
    test's deadline, so only the cap can close it); once the three are gone the server answers again."""
    held = [connect(server) for _ in range(3)]  # accepted in order: the fourth is always the one past the cap
    extra = connect(server)
    started = time.monotonic()
    assert closed_by_server(extra) and time.monotonic() - started < DEADLINE_S
    for conn in held:
        conn.close()
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the server drops the three as it reads their ends: retry until it does
        try:
            assert httpx.get(server + "/", timeout=DEADLINE_S).text == "ok"
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_flags_reach_server_args() -> None:
    args = parse_args(["--header-timeout", "3", "--max-connections", "100", "--max-header-bytes", "8192"])
    assert (args.header_timeout, args.max_connections, args.max_header_bytes) == (3.0, 100, 8192)
    with pytest.raises(SystemExit):
        parse_args(["--header-timeout", "0"])
