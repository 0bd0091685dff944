"""``radixserve serve``: load the engine, log the resolved configuration, run uvicorn until a signal.

The port is bound before the model loads: a port already in use fails in
milliseconds, not after a 30 s load.

SIGINT / SIGTERM: stop accepting connections, give in-flight requests up to
``--graceful-shutdown-timeout`` seconds to finish, abort the rest (their slots
and locks come back), stop the scheduler thread, exit 0. The abort comes a
little before the limit (``GRACE_LEAD_S``), so that aborted requests still get
their answer (a 503 ``shutting_down``; a stream, an error event and ``[DONE]``)
before uvicorn cancels what is left. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

import uvicorn

from radixserve.server.args import ServerArgs, usage_error
from radixserve.server.connections import uvicorn_limits

if TYPE_CHECKING:
    from radixserve.kv_events.publisher import KVEventPublisher

logger = logging.getLogger("radixserve.server")
T = TypeVar("T")
GRACE_LEAD_S = 0.5  # abort in-flight requests this long before the grace limit (at most half of it)


class _Server(uvicorn.Server):
    """uvicorn re-raises the signal after a graceful shutdown (exit status 143/130); we exit 0.

    ``on_grace_limit`` (blocking; run on a thread) aborts every in-flight request just before
    uvicorn would cancel their handlers, so they answer instead of dying mid-response.
    """

    def __init__(self, config: uvicorn.Config, on_grace_limit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_grace_limit = on_grace_limit

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace, callback = self.config.timeout_graceful_shutdown, self.on_grace_limit
        timer = None
        if grace is not None and callback is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, grace - min(GRACE_LEAD_S, grace / 2))
            timer = loop.call_later(delay, lambda: loop.run_in_executor(None, callback))
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        logger.info("received %s: finishing in-flight requests, then exiting", signal.Signals(sig).name)
        self.should_exit = True


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it); SystemExit at once if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        logger.error("cannot listen on %s:%d: %s", host, port, exc.strerror)
        raise SystemExit(f"radixserve serve: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def off_the_main_thread(build: Callable[[], T]) -> T:
    """``build()`` run on a thread of its own that then ends, so the main thread never runs torch's parallel work.

    libgomp (torch's OpenMP) keeps a pool of worker threads for each thread that has run a parallel region, until
    that thread exits. Loaded on the main thread, which lives on to serve HTTP, the model would leave the main
    thread's pool behind; the scheduler thread then makes a second one, and with more OpenMP threads than cores
    libgomp stops spinning at its barriers (each wake-up a futex call): at ``--num-threads 2`` on 2 cores a
    SmolLM2 decode step took 17 ms instead of 9, slower than one thread (docs: benchmarks/history, §12).
    Built here, that pool ends with the thread. A daemon thread, joined: Ctrl-C during the load still stops the
    server at once."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(build())
        except BaseException as exc:  # re-raised on the main thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="radixserve-load", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


def kv_events_before_the_model(args: ServerArgs, sock: socket.socket) -> KVEventPublisher | None:
    """The KV events publisher, its sockets bound (None: events off). An endpoint that cannot be bound (a port
    in use, a missing ipc directory) is a usage error, exit 2, before any weights are read."""
    from radixserve.kv_events.publisher import KVEventsBindError
    from radixserve.server.app import open_kv_events

    try:
        return open_kv_events(args)
    except KVEventsBindError as exc:
        sock.close()
        usage_error(f"--kv-events-endpoint / --kv-events-config: {exc}")


def serve(args: ServerArgs) -> None:
    configure_logging(args.log_level)
    logger.info("resolved server args: %s", json.dumps(args.resolved(), sort_keys=True))
    sock = listen_socket(args.host, args.port)  # before the model loads: fail fast
    events = kv_events_before_the_model(args, sock)  # so are the KV events' sockets
    from radixserve.engine import Engine
    from radixserve.model.summary import format_summary
    from radixserve.server.app import create_app

    try:
        engine = off_the_main_thread(lambda: Engine(args.engine))
    except BaseException:
        if events is not None:
            events.close()  # its sockets and replay thread: the process must still exit
        raise
    info = engine.describe()
    logger.info("%s", format_summary(info))
    logger.info("engine: %s", json.dumps(info, sort_keys=True))
    app = create_app(engine, args, events)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=int(args.graceful_shutdown_timeout),
        log_config=None,  # keep our logging format
        **uvicorn_limits(args.header_timeout, args.max_connections, args.max_header_bytes, args.keep_alive_timeout),
    )
    _Server(config, app.state.radixserve.worker.stop).run(sockets=[sock])
    logger.info("server stopped")
