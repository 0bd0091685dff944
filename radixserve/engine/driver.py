"""The engine's one loop: an inbox of commands, one scheduler step, each request's new tokens to its sink.

Whoever drives the engine goes through here. Offline ``generate()`` submits its requests and
turns the loop on the caller's thread until they finish; the server's worker thread turns it
until shutdown (``run_forever``). Other threads talk to the loop through one inbox (a
thread-safe queue of commands): ``submit`` a request with a sink, ``abort`` one, or ``call`` a
function between two steps (``flush_cache``, ``snapshot``, ``cache_view``). Each turn runs the
inbox's commands, one scheduler step, then hands every submitted request's new tokens to its
sink as a ``Delta`` (the last one carries the result). Sinks are called on the loop's thread;
the server's sinks hop onto the event loop with ``call_soon_threadsafe``.

Only the loop's thread touches the scheduler, the cache and the allocator, so none of them
needs a lock; one thread at a time may turn the loop (a second one is a RuntimeError, not a
race). torch releases the GIL inside its kernels and Python switches threads every few
milliseconds, so the server's ``/health`` and ``/metrics`` answer while a long prefill runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from radixserve.cache.events import KVEvent
from radixserve.core import ErrorKind, GenerateResult, TopLogprobs
from radixserve.engine.output import LogprobTokens, OutputCursor
from radixserve.engine.step import StepExecutor
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.loop import Scheduler
from radixserve.scheduler.request import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.5  # an idle loop wakes this often (KV events of a command are published within it)


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


class LoadStats(NamedTuple):
    """The loop's figures after a step (the server's gauges and counters)."""

    num_running: int
    num_waiting: int
    token_usage: float  # share of KV slots live requests hold
    evicted_tokens: int  # since start
    retractions: int  # since start


class LoopListener:
    """What a server hears from the loop, on the loop's thread; this base class ignores it all."""

    def on_tokens(self, first: bool, seconds: float) -> None:
        """A request got new tokens: ``seconds`` since its arrival (``first``) or since its last tokens."""

    def on_batch(self, batch: ScheduledBatch, began: float, ended: float) -> None:
        """The model step ran ``batch`` from ``began`` to ``ended`` (perf_counter; before ``process``)."""

    def on_finish(self, req: Request, result: GenerateResult) -> None:
        """A submitted request finished (whatever the reason); ``result`` is ``req.result()``."""

    def on_step(self, load: LoadStats) -> None:
        """After every step and every abort."""

    def on_kv_events(self, events: list[KVEvent]) -> None:
        """What the cache stored and removed since the last call (only with ``enable_kv_events``)."""


class RequestsInFlight(RuntimeError):
    """The cache cannot be flushed while a request holds part of it."""


# What ``flush_cache`` can drop: the KV pool (L1), the host tier (L2), the disk tier (L3).
CACHE_TIERS = ("device", "host", "disk")


def check_flush_tiers(tiers: Sequence[str]) -> tuple[str, ...]:
    """``tiers`` as a tuple, each one of CACHE_TIERS (ValueError naming the bad one; none at all is one too)."""
    if isinstance(tiers, str):
        tiers = [tiers]
    unknown = [t for t in tiers if t not in CACHE_TIERS]
    if unknown or not tiers:
        raise ValueError(f"tiers must be some of {', '.join(CACHE_TIERS)}, got {list(tiers)!r}")
    return tuple(dict.fromkeys(tiers))


@dataclass(eq=False)
class _Live:
    req: Request
    sink: Sink
    index: int
    cursor: OutputCursor = field(default_factory=OutputCursor)  # what was delivered
    last_token_time: float = 0.0


class Driver:
    """The loop over one scheduler and its step executor; ``Engine`` wires them to a model."""

    def __init__(self, scheduler: Scheduler, executor: StepExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.failure: BaseException | None = None  # set if ``run_forever`` died: every request failed
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # submitted with a sink, not finished yet
        self._listener: LoopListener | None = None
        self._owner_lock = threading.Lock()  # held by the thread that turns the loop
        self._owner: threading.Thread | None = None

    # ---- the inbox (any thread) --------------------------------------------------------------------

    def submit(self, req: Request, sink: Sink | None = None, index: int = 0) -> None:
        """Queue ``req`` (from ``make_request``); ``sink`` gets its deltas, the last one with the result."""
        self._inbox.put(lambda: self._add(req, sink, index))

    def abort(self, rid: int) -> None:
        """Abort a submitted request wherever it is (queued, running, or still in the inbox). Idempotent."""
        self._inbox.put(lambda: self._abort(rid))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the loop's thread between two steps; wrap with ``asyncio.wrap_future``."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.failure is not None:  # nobody would ever run it
            future.set_exception(RuntimeError(f"the engine loop stopped: {self.failure!r}"))
            return future

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        self._inbox.put(run)
        return future

    # ---- turning the loop ---------------------------------------------------------------------------

    def run_until_done(self, requests: Sequence[Request]) -> None:
        """Submit ``requests`` and turn the loop on this thread until every one has finished."""
        with self._owning():
            for req in requests:
                self.submit(req)
            while any(req.finish_reason is None for req in requests):
                self._turn(block=False)
                if not self.scheduler.has_work() and any(req.finish_reason is None for req in requests):
                    raise RuntimeError("a request left the scheduler unfinished")

    def run_forever(
        self, stopping: threading.Event, listener: LoopListener | None = None, close_timeout: float = 30.0
    ) -> None:
        """Turn the loop until ``stopping`` is set; then abort what is in flight and close the cache tiers.

        A failure of the loop itself fails every request (each sink gets its final delta) and is
        kept in ``failure``: better loud than a hang.
        """
        with self._owning():
            self._listener = listener
            try:
                while self._turn(block=True, stopping=stopping):
                    pass
                self._drain(block=False)
                for rid in list(self._live):
                    self._abort(rid, "the server is shutting down", "shutdown")
                self.close(close_timeout)  # dirty pages to the disk tier
            except BaseException as exc:  # a bug in the loop: fail everyone loudly rather than hang
                logger.exception("the engine loop died")
                self.failure = exc
                self._fail_everyone(f"internal error: {exc}")
            finally:
                self._listener = None

    def step(self) -> list[Request]:
        """One scheduling round and model step; the requests that finished in it (their sinks were told)."""
        self._check_thread()
        batch = self.scheduler.schedule()
        began = time.perf_counter()
        outputs = self.executor.run(batch)
        if self._listener is not None and batch:  # one call a step: tracing's chunk and decode times
            self._listener.on_batch(batch, began, time.perf_counter())
        finished = self.scheduler.process(batch, outputs)
        self._publish()
        return finished

    def _turn(self, block: bool, stopping: threading.Event | None = None) -> bool:
        """The inbox's commands (waiting for one if idle and ``block``), then one step; False: stop now."""
        self._drain(block=block and not self.scheduler.has_work())
        self._publish_events()  # what the commands did (a flush clears everything)
        if stopping is not None and stopping.is_set():
            return False
        if self.scheduler.has_work():
            self.step()
            self._publish_events()
        return True

    @contextlib.contextmanager
    def _owning(self) -> Iterator[None]:
        if not self._owner_lock.acquire(blocking=False):
            raise RuntimeError("another thread turns this engine's loop (a server's?): submit() or call() to it")
        self._owner = threading.current_thread()
        try:
            yield
        finally:
            self._owner = None
            self._owner_lock.release()

    def _check_thread(self) -> None:
        """Scheduler, cache and allocator belong to the loop's thread while it turns."""
        owner = self._owner
        if owner is not None and owner is not threading.current_thread():
            raise RuntimeError("the engine's loop runs on another thread: use engine.call(...) to reach it")

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    # ---- the cache's life cycle (the loop's thread) --------------------------------------------------

    def flush_cache(self, tiers: Sequence[str] = CACHE_TIERS) -> int:
        """Drop every cached prefix from the tiers named (default all: ``device`` the KV pool, ``host`` L2,
        ``disk`` L3, whose files are deleted by its writer thread, off this loop); the pool tokens dropped.
        Afterwards no tier named serves any prefix cached before. KV events report each removal (the pool's
        as one clear). ValueError for an unknown tier, RequestsInFlight (nothing dropped) while any request
        is queued or running: it may hold part of the cache, and a prefetch may be filling L2."""
        self._check_thread()
        tiers = check_flush_tiers(tiers)
        if self.scheduler.has_work():
            raise RequestsInFlight("cache not flushed: requests are in flight")
        cache = self.scheduler.cache
        dropped = 0
        if "device" in tiers:
            dropped = cache.total_size()
            cache.reset()
        if cache.tiers is not None:
            host, disk = cache.tiers.clear("host" in tiers, "disk" in tiers)
            logger.info(
                "cache flushed (%s): %d pool tokens, %d host and %d disk pages", ",".join(tiers), dropped, host, disk
            )
        return dropped

    def close(self, timeout: float = 30.0) -> bool:
        """Flush the cache tiers: every cached page the disk tier lacks is written, for up to
        ``timeout`` s; then the directory is released. True if everything landed (or no disk tier).

        Call it from the thread that steps the engine, with nothing in flight.
        """
        self._check_thread()
        cache = self.scheduler.cache
        tiers = cache.tiers
        if tiers is None:
            return True
        start = time.monotonic()
        if tiers.disk is not None and tiers.disk.writable:
            flush = getattr(cache, "flush_to_disk", None)
            if flush is not None:
                flush()
        done = tiers.close(timeout)
        logger.info("cache tiers closed in %.2f s%s", time.monotonic() - start, "" if done else ": flush timed out")
        return done

    def load(self) -> LoadStats:
        scheduler = self.scheduler
        return LoadStats(
            len(scheduler.running),
            len(scheduler.waiting),
            scheduler.token_usage(),
            scheduler.cache.evicted_tokens,
            scheduler.stats.retractions,
        )

    # ---- requests and their sinks (the loop's thread) ------------------------------------------------

    def _add(self, req: Request, sink: Sink | None, index: int) -> None:
        if sink is not None:
            self._live[req.rid] = _Live(req, sink, index)
        self.scheduler.add(req)

    def _abort(self, rid: int, error: str | None = None, kind: ErrorKind = "engine") -> None:
        live = self._live.get(rid)
        if live is None:
            return  # already finished, or never submitted
        self.scheduler.abort(live.req, error, kind)
        self._publish()

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
        if self._listener is not None:
            self._listener.on_step(self.load())

    def _publish_events(self) -> None:
        log = self.scheduler.cache.events
        if self._listener is not None and log is not None:
            self._listener.on_kv_events(log.drain())

    def _observe_tokens(self, live: _Live, now: float) -> None:
        if self._listener is None or len(live.req.output_ids) == live.cursor.tokens:
            return
        first = live.cursor.tokens == 0
        self._listener.on_tokens(first, now - (live.req.arrival_time if first else live.last_token_time))
        live.last_token_time = now

    def _deliver(self, live: _Live, final: bool) -> None:
        req = live.req
        new = live.cursor.take(req)
        delta = Delta(req.rid, live.index, new.token_ids, new.logprobs, new.top_logprobs, new.text, new.listed)
        if final:
            delta.result = result = req.result()
            if self._listener is not None:
                self._listener.on_finish(req, result)
        try:
            live.sink(delta)
        except Exception:  # the listener is gone (event loop closed): nothing to tell
            logger.debug("dropped a delta for request %d", req.rid, exc_info=True)
