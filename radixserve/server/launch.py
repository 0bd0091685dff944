"""``radixserve serve``: load the engine, log the resolved configuration, run uvicorn until a signal.

SIGINT / SIGTERM: stop accepting connections, give in-flight requests up to
``--graceful-shutdown-timeout`` seconds to finish, abort the rest (their slots
and locks come back), stop the scheduler thread, exit 0. A second SIGINT exits
at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from radixserve.server.args import ServerArgs

logger = logging.getLogger("radixserve.server")


class _Server(uvicorn.Server):
    """uvicorn re-raises the signal after a graceful shutdown (exit status 143/130); we exit 0."""

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


def serve(args: ServerArgs) -> None:
    configure_logging(args.log_level)
    logger.info("resolved server args: %s", json.dumps(args.resolved(), sort_keys=True))
    from radixserve.engine import Engine
    from radixserve.server.app import create_app

    engine = Engine(args.engine)
    logger.info("engine: %s", json.dumps(engine.describe(), sort_keys=True))
    config = uvicorn.Config(
        create_app(engine, args),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=int(args.graceful_shutdown_timeout),
        log_config=None,  # keep our logging format
    )
    _Server(config).run()
    logger.info("server stopped")
