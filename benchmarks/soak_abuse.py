"""Abusive clients for ``bench soak``, and a probe that times small requests while they run.

- huge-body clients POST a ``--huge-body-bytes`` prompt (16 MB by default: past the
  server's ``--max-request-bytes``, a 413) and one a quarter that size (under the byte
  limit, over what the context can hold: a 400 before tokenizing), again and again;
- slow-loris clients open a connection, send the headers of a POST, then trickle its
  body one byte every ``LORIS_INTERVAL_S``, never finishing, for as long as the load runs;
- the probe sends a two-token streamed completion every ``PROBE_INTERVAL_S`` and records
  its time to first token: with the abuse running, small requests must keep moving.

Anything but a 413 or 400 to a huge body (a 5xx, a dropped connection) is unexpected.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

LORIS_INTERVAL_S = 1.0
PROBE_INTERVAL_S = 0.2
HUGE_PAUSE_S = 0.5  # between one client's huge bodies: the point is the server's handling, not our upload rate


@dataclass
class AbuseLog:
    huge_sent: int = 0
    huge_rejected: int = 0  # 413 or 400, as they must be
    huge_unexpected: list[str] = field(default_factory=list)
    loris_connections: int = 0
    small_ttft_s: list[float] = field(default_factory=list)
    small_accepted: int = 0  # the probe's requests the server took (they count in its requests_total)
    small_failed: list[str] = field(default_factory=list)

    def ttft_p99(self) -> float | None:
        if not self.small_ttft_s:
            return None
        ordered = sorted(self.small_ttft_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        p99 = self.ttft_p99()
        return {
            "huge_bodies_sent": self.huge_sent,
            "huge_bodies_rejected": self.huge_rejected,
            "slow_loris_connections": self.loris_connections,
            "small_requests": len(self.small_ttft_s),
            "small_ttft_p99_s": None if p99 is None else round(p99, 4),
        }

    def problems(self, max_small_ttft_s: float | None) -> list[str]:
        out = [f"huge body: {detail}" for detail in self.huge_unexpected[:5]]
        out += [f"small request failed: {detail}" for detail in self.small_failed[:5]]
        p99 = self.ttft_p99()
        if max_small_ttft_s is not None and p99 is not None and p99 > max_small_ttft_s:
            out.append(f"small requests' TTFT p99 {p99:.2f} s exceeds {max_small_ttft_s} s while abused")
        return out


def huge_body(model: str, size_bytes: int) -> bytes:
    """A completions body of about ``size_bytes``: one long text prompt."""
    words = max(1, size_bytes // 3)
    return json.dumps({"model": model, "prompt": "w5 " * words, "max_tokens": 1}).encode()


async def huge_body_client(base_url: str, bodies: list[bytes], stop: asyncio.Event, log: AbuseLog) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=30.0)) as client:
        index = 0
        while not stop.is_set():
            body = bodies[index % len(bodies)]
            index += 1
            log.huge_sent += 1
            try:
                response = await client.post(base_url + "/v1/completions", content=body)
                if response.status_code in (400, 413):
                    log.huge_rejected += 1
                else:
                    log.huge_unexpected.append(f"{len(body)} bytes -> {response.status_code} {response.text[:200]}")
            except httpx.HTTPError as exc:
                log.huge_unexpected.append(f"{len(body)} bytes -> {type(exc).__name__}: {exc}")
            await asyncio.sleep(HUGE_PAUSE_S)


async def slow_loris_client(base_url: str, stop: asyncio.Event, log: AbuseLog) -> None:
    """Headers, then a byte per interval, until the load is over; then hang up."""
    parts = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    log.loris_connections += 1
    try:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        writer.write((head + "Content-Length: 1000000\r\n\r\n").encode())
        while not stop.is_set():
            writer.write(b" ")
            await writer.drain()
            try:
                await asyncio.wait_for(stop.wait(), LORIS_INTERVAL_S)
            except TimeoutError:
                pass
    except (ConnectionError, OSError):
        pass  # the server may hang up on it: that is allowed
    finally:
        writer.close()


async def small_probe(base_url: str, model: str, stop: asyncio.Event, log: AbuseLog) -> None:
    body = {"model": model, "prompt": "w5 w6", "max_tokens": 2, "stream": True, "ignore_eos": True}  # text: tokenized
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=30.0)) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                async with client.stream("POST", base_url + "/v1/completions", json=body) as response:
                    log.small_accepted += response.status_code == 200
                    if response.status_code != 200:
                        log.small_failed.append(f"{response.status_code} {(await response.aread())[:200]!r}")
                    else:
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                log.small_ttft_s.append(time.perf_counter() - start)
                                break
            except httpx.HTTPError as exc:
                log.small_failed.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(PROBE_INTERVAL_S)


def start_abuse(
    base_url: str, model: str, huge_clients: int, loris_clients: int, huge_bytes: int, stop: asyncio.Event
) -> tuple[AbuseLog, list[asyncio.Future[None]]]:
    """Start the abusive clients and the probe (the probe only when there is abuse to measure against)."""
    log = AbuseLog()
    tasks: list[asyncio.Future[None]] = []
    if huge_clients or loris_clients:
        bodies = [huge_body(model, huge_bytes), huge_body(model, huge_bytes // 4)]
        tasks += [asyncio.ensure_future(huge_body_client(base_url, bodies, stop, log)) for _ in range(huge_clients)]
        tasks += [asyncio.ensure_future(slow_loris_client(base_url, stop, log)) for _ in range(loris_clients)]
        tasks.append(asyncio.ensure_future(small_probe(base_url, model, stop, log)))
    return log, tasks
