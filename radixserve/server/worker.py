"""The server's loop thread: it turns the engine's loop (engine/driver.py) until shutdown.

The HTTP side submits to the engine through this worker and never around it: it
claims room first (``reserve``: ``Overloaded``, a 503, when the server is full),
then ``submit``s, ``abort``s, or ``call``s a function between two steps (flush
the cache, summarise it). The engine's loop calls the sinks and this server's
``ServerListener`` (Prometheus figures, KV events) on this thread.

Only this thread touches the scheduler, the cache and the allocator (the
driver's docstring says why /health and /metrics still answer during a long
prefill). ``stop`` aborts what is in flight (every sink gets its final delta)
and closes the cache tiers; a loop that dies fails every request and shows in
``/health``.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from radixserve.cache.events import KVEvent
from radixserve.core import GenerateResult
from radixserve.engine import Engine
from radixserve.engine.driver import Delta, LoadStats, LoopListener, Sink
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.request import Request
from radixserve.server.metrics import ServerMetrics

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from radixserve.server.tracing import RequestTracer

T = TypeVar("T")


class Overloaded(RuntimeError):
    """More requests in flight than the server accepts (``--max-queued-requests``)."""


class ServerListener(LoopListener):
    """The loop's figures into Prometheus metrics (``--enable-metrics``), its KV events onto ZMQ, its
    timeline into request traces (``--otlp-traces-endpoint``)."""

    def __init__(
        self, metrics: ServerMetrics | None, events: KVEventPublisher | None, tracer: RequestTracer | None = None
    ) -> None:
        self.metrics = metrics
        self.events = events
        self.tracer = tracer

    def on_tokens(self, first: bool, seconds: float) -> None:
        if self.metrics is not None:
            (self.metrics.ttft if first else self.metrics.itl).observe(seconds)

    def on_batch(self, batch: ScheduledBatch, began: float, ended: float) -> None:
        if self.tracer is not None:
            self.tracer.on_batch(batch, began, ended)

    def on_finish(self, req: Request, result: GenerateResult) -> None:
        if self.tracer is not None:
            self.tracer.on_finish(req, result)
        if self.metrics is not None:
            self.metrics.on_finish(
                result.prompt_tokens,
                result.cached_tokens,
                len(result.output_ids),
                result.finish_reason,
                result.e2e_latency,
                result.spec,
            )

    def on_step(self, load: LoadStats) -> None:
        if self.metrics is not None:
            self.metrics.on_step(*load)

    def on_kv_events(self, events: list[KVEvent]) -> None:
        if self.events is not None:
            self.events.publish(events)


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics | None = None,
        max_in_flight: int = 1 << 30,
        events: KVEventPublisher | None = None,
        close_timeout: float = 30.0,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.engine = engine
        self.close_timeout = close_timeout  # how long shutdown may spend flushing cache tiers to disk
        self.events = events
        self.listener = ServerListener(metrics, events, tracer)
        self.max_in_flight = max_in_flight
        self._in_flight = 0  # submitted and not yet finished (any thread reads; changed under _count_lock)
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-scheduler", daemon=True)

    @property
    def failure(self) -> BaseException | None:
        """What killed the engine's loop (None while it runs): /health reports it."""
        return self.engine.failure

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

        def counted(delta: Delta) -> None:
            if delta.result is not None:  # its last delta: the room it reserved is free again
                with self._count_lock:
                    self._in_flight -= 1
            sink(delta)

        self.engine.submit(req, counted, index)

    def abort(self, rid: int) -> None:
        """Abort a request wherever it is (queued, running, or still in the inbox). Idempotent."""
        self.engine.abort(rid)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the scheduler thread between two steps; wrap with ``asyncio.wrap_future``."""
        if not self.alive():  # nobody would ever run it
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            future.set_exception(RuntimeError(f"the scheduler stopped: {self.failure!r}"))
            return future
        return self.engine.call(fn)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight (sinks get their final delta), then end the thread."""
        self._stopping.set()
        self.engine.call(lambda: None)  # wake it
        self._thread.join(timeout + self.close_timeout)

    def _run(self) -> None:
        self.engine.run_forever(self._stopping, self.listener, self.close_timeout)
