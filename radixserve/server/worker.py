"""The scheduler thread: owns the engine's scheduler and cache; the HTTP loop never steps the model.

The HTTP side talks to it through one inbox (a thread-safe queue of commands):
``submit`` a request with a sink, ``abort`` one, or ``call`` a function between
two steps (flush the cache, summarise it). The thread drains the inbox, runs one
scheduler step, then hands every request's new tokens to its sink as a
``Delta`` (the last one carries the result). Sinks are called on this thread;
the server's sinks hop onto the event loop with ``call_soon_threadsafe``.

Only this thread touches the scheduler, the cache and the allocator, so none of
them needs a lock. torch releases the GIL inside its kernels and Python switches
threads every few milliseconds, so ``/health`` and ``/metrics`` answer while a
long prefill runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from radixserve.core import ErrorKind, GenerateResult, TopLogprobs
from radixserve.engine import Engine
from radixserve.engine.output import LogprobTokens, OutputCursor
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.scheduler.request import Request
from radixserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Delta:
    """What one request produced since its last delta; ``result`` is set on its last one."""

    rid: int
    index: int  # the request's place in its HTTP call (prompt x choice)
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    text: str = ""  # new text (the engine's output stage: never past a stop string, never half a character)
    listed: LogprobTokens = field(default_factory=lambda: LogprobTokens([], [], [], []))  # tokens to list logprobs of
    result: GenerateResult | None = None


Sink = Callable[[Delta], None]


@dataclass(eq=False)
class _Live:
    req: Request
    sink: Sink
    index: int
    cursor: OutputCursor = field(default_factory=OutputCursor)  # what was delivered
    last_token_time: float = 0.0


class Overloaded(RuntimeError):
    """More requests in flight than the server accepts (``--max-queued-requests``)."""


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics | None = None,
        max_in_flight: int = 1 << 30,
        events: KVEventPublisher | None = None,
        close_timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.close_timeout = close_timeout  # how long shutdown may spend flushing cache tiers to disk
        self.events = events
        self.max_in_flight = max_in_flight
        self._in_flight = 0  # submitted and not yet finished (any thread reads; changed under _count_lock)
        self._count_lock = threading.Lock()
        self.scheduler = engine.scheduler
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-scheduler", daemon=True)
        self.failure: BaseException | None = None  # set if the loop itself died: /health reports it

    # ---- the HTTP side's commands (any thread) ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def in_flight(self) -> int:
        return self._in_flight

    def reserve(self, count: int) -> None:
        """Claim room for ``count`` requests before submitting them; Overloaded if there is none."""
        if self._stopping.is_set():
            raise RuntimeError("the server is shutting down")
        if not self.alive():
            raise RuntimeError(f"the scheduler stopped: {self.failure!r}")
        with self._count_lock:
            if self._in_flight + count > self.max_in_flight:
                raise Overloaded(f"the server has {self._in_flight} requests in flight (at most {self.max_in_flight})")
            self._in_flight += count

    def submit(self, req: Request, sink: Sink, index: int = 0) -> None:
        """Queue a request (after ``reserve``); its sink gets deltas, the last with the result."""
        self._inbox.put(lambda: self._add(req, sink, index))

    def abort(self, rid: int) -> None:
        """Abort a request wherever it is (queued, running, or still in the inbox). Idempotent."""
        self._inbox.put(lambda: self._abort(rid))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the scheduler thread between two steps; wrap with ``asyncio.wrap_future``."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive():  # nobody would ever run it
            future.set_exception(RuntimeError(f"the scheduler stopped: {self.failure!r}"))
            return future

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        self._inbox.put(run)
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight (sinks get their final delta), then end the thread."""
        self._stopping.set()
        self._inbox.put(lambda: None)  # wake it
        self._thread.join(timeout + self.close_timeout)

    # ---- the scheduler thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._drain(block=not self.scheduler.has_work())
                self._publish_events()  # what the commands did (a flush clears everything)
                if self._stopping.is_set():
                    self._drain(block=False)
                    for rid in list(self._live):
                        self._abort(rid, "the server is shutting down", "shutdown")
                    self.engine.close(self.close_timeout)  # dirty pages to the disk tier
                    break
                if self.scheduler.has_work():
                    self.engine.step()
                    self._publish()
                    self._publish_events()
        except BaseException as exc:  # a bug in the loop: fail everyone loudly rather than hang
            logger.exception("the scheduler loop died")
            self.failure = exc
            self._fail_everyone(f"internal error: {exc}")

    def _fail_everyone(self, error: str) -> None:
        for live in self._live.values():
            try:
                self.scheduler.abort(live.req, error)
            except Exception:  # the scheduler's state is what broke: the request is over all the same
                logger.exception("aborting request %d after the loop died", live.req.rid)
                if live.req.finish_reason is None:
                    live.req.finish("abort", error)
            self._deliver(live, final=True)
        self._live.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: Request, sink: Sink, index: int) -> None:
        if self._stopping.is_set():
            self.scheduler.abort(req, "the server is shutting down", "shutdown")
            self._deliver(_Live(req, sink, index), final=True)
            return
        live = _Live(req, sink, index)
        self._live[req.rid] = live
        self.scheduler.add(req)

    def _abort(self, rid: int, error: str | None = None, kind: ErrorKind = "engine") -> None:
        live = self._live.get(rid)
        if live is None:
            return  # already finished, or never submitted
        self.scheduler.abort(live.req, error, kind)
        self._publish()

    def _publish(self) -> None:
        """Deliver every live request's new tokens; finished ones get their result and leave."""
        now = time.perf_counter()
        done = []
        for rid, live in self._live.items():
            req = live.req
            finished = req.finish_reason is not None
            if len(req.output_ids) > live.cursor.tokens or finished:
                self._observe_tokens(live, now)
                self._deliver(live, final=finished)
            if finished:
                done.append(rid)
        for rid in done:
            del self._live[rid]
        if self.metrics is not None:
            scheduler = self.scheduler
            self.metrics.on_step(
                len(scheduler.running),
                len(scheduler.waiting),
                scheduler.token_usage(),
                scheduler.cache.evicted_tokens,
                scheduler.stats.retractions,
            )

    def _publish_events(self) -> None:
        log = self.scheduler.cache.events
        if self.events is not None and log is not None:
            self.events.publish(log.drain())

    def _observe_tokens(self, live: _Live, now: float) -> None:
        if self.metrics is None or len(live.req.output_ids) == live.cursor.tokens:
            return
        if live.cursor.tokens == 0:
            self.metrics.ttft.observe(now - live.req.arrival_time)
        else:
            self.metrics.itl.observe(now - live.last_token_time)
        live.last_token_time = now

    def _deliver(self, live: _Live, final: bool) -> None:
        req = live.req
        new = live.cursor.take(req)
        delta = Delta(req.rid, live.index, new.token_ids, new.logprobs, new.top_logprobs, new.text, new.listed)
        if final:
            with self._count_lock:
                self._in_flight -= 1
            delta.result = result = req.result()
            if self.metrics is not None:
                self.metrics.on_finish(
                    result.prompt_tokens,
                    result.cached_tokens,
                    len(result.output_ids),
                    result.finish_reason,
                    result.e2e_latency,
                )
        try:
            live.sink(delta)
        except Exception:  # the listener is gone (event loop closed): nothing to tell
            logger.debug("dropped a delta for request %d", req.rid, exc_info=True)
