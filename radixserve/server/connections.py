"""Bounds on what any client can hold: uvicorn's h11 protocol with a request-head deadline and a connection cap.

uvicorn closes a keep-alive connection idle after a response (``--keep-alive-timeout``), but a connection that
never sends a byte, or sends its head a byte at a time, stays open for ever (21,000 such slow-loris connections
used up the file descriptors and every request failed), and h11's head-size limit only holds while a head is
incomplete, so a 256 MB head that arrived whole was parsed. Here a request head must be complete
``--header-timeout`` seconds after the connection opens (or after the previous response's keep-alive window),
a head longer than ``--max-header-bytes`` gets a 400 however it arrives, and past ``--max-connections`` open
connections a new one is closed at once, before it costs more than its descriptor.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

FD_HEADROOM = 256  # descriptors kept for the model files, the cache directory, logs and the KV events sockets


def default_max_connections() -> int:
    """Connections allowed at once when no flag says: the soft descriptor limit, raised to the hard one where the
    system allows, less FD_HEADROOM."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    limit = 65536 if soft == resource.RLIM_INFINITY else soft
    return max(16, min(limit, 65536) - FD_HEADROOM)


HEAD_END = b"\r\n\r\n"


def guarded_protocol(header_timeout: float, max_connections: int, max_header_bytes: int) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config's ``http``) with these bounds."""

    class GuardedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None
        _head_bytes = 0  # of the head now arriving, before the last chunk
        _head_tail = b""  # its last bytes: HEAD_END may straddle two chunks

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._head_too_long(data):
                self.send_400_response("Request head too large.")
                return
            super().data_received(data)

        def _head_too_long(self, data: bytes) -> bool:
            """Whether the head now arriving (``data`` its next chunk) passes max_header_bytes."""
            seen = self._head_tail + data
            end = seen.find(HEAD_END)
            if end >= 0:
                length = self._head_bytes - len(self._head_tail) + end + len(HEAD_END)
                self._head_bytes, self._head_tail = 0, b""  # the head is whole: the next one starts afresh
                return length > max_header_bytes
            self._head_bytes += len(data)
            self._head_tail = seen[-(len(HEAD_END) - 1) :]
            return self._head_bytes > max_header_bytes

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning("connection limit (%d) reached: closing a new connection", max_connections)
                transport.close()
                return
            self._arm(header_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm(self.timeout_keep_alive + header_timeout)  # the next head, after an idle keep-alive

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, delay: float) -> None:
            self._disarm()
            self._head_deadline = self.loop.call_later(delay, self._head_due)

        def _disarm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_due(self) -> None:
            """No complete request head yet (h11 still waits for one): close. A request being served is left."""
            self._head_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_limits(
    header_timeout: float, max_connections: int, max_header_bytes: int, keep_alive: float
) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for these bounds (``max_connections`` 0: ``default_max_connections``)."""
    return {
        "http": guarded_protocol(header_timeout, max_connections or default_max_connections(), max_header_bytes),
        "h11_max_incomplete_event_size": max_header_bytes,
        "timeout_keep_alive": keep_alive,
    }
