"""Request tracing (``--otlp-traces-endpoint``): one OpenTelemetry trace per request, sent over OTLP/HTTP.

    radixserve.request          arrival -> finish (kind SERVER; its parent: the caller's ``traceparent``)
      radixserve.queue          arrival -> first admission
      radixserve.tier_load      pages copied back from L2 / L3 at admission (with cache tiers)
      radixserve.prefill        one per prefill chunk: the model step that ran it
      radixserve.decode         the first decode step -> finish

Spans are made when a request finishes, from times the loop keeps anyway: the request's arrival,
first-token and finish times (scheduler/request.py), each model step's start and end (the driver
times a step once: ``LoopListener.on_batch``), each tier load's (the cache's ``TierLoad``). Nothing
runs per token; with tracing off nothing runs at all (``ServerState.tracer`` is None) and this
module, the only one that imports OpenTelemetry, is never imported. With ``--replicas`` the front
makes a ``radixserve.route`` span and forwards its own ``traceparent``, so each replica's request
span is its child. The SDK is an optional extra: ``pip install 'radixserve[tracing]'``.

Thread-safety: ``begin`` runs on the event loop before the requests are submitted; ``on_batch``
and ``on_finish`` on the loop's thread. They share one dict, changed one key at a time. A finished
request's record then goes, through a queue, to the thread that makes its spans.
"""

from __future__ import annotations

import queue
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from radixserve.cache import TierLoad
from radixserve.core import GenerateResult
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.request import Request

EXPORT_DELAY_MS = 1000  # spans go out in batches at least this often


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given, or with ``/v1/traces`` when it names no path."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL (http://host:4318), got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    """One process's tracer and W3C trace-context propagation (``traceparent``, ``tracestate``)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("radixserve")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_endpoint(cls, endpoint: str, service: str = "radixserve") -> Tracing:
        """Spans batched to an OTLP/HTTP collector (an export never blocks the caller: its own thread sends)."""
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        return cls(provider)

    def extract(self, headers: Mapping[str, str]) -> Context:
        """The caller's trace context (an empty one, a new trace, without a valid ``traceparent``)."""
        return self.propagator.extract({k.lower(): v for k, v in headers.items()})

    def headers(self, span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span`` as the parent."""
        out: dict[str, str] = {}
        self.propagator.inject(out, set_span_in_context(span))
        return out

    def route_span(self, path: str, headers: Sequence[tuple[str, str]]) -> tuple[Span, tuple[tuple[str, str], ...]]:
        """The front's span for one routed call, and the call's headers with its ``traceparent`` instead."""
        span = self.tracer.start_span(
            "radixserve.route", self.extract(dict(headers)), SpanKind.SERVER, {"url.path": path}
        )
        own = self.headers(span)
        kept = tuple((k, v) for k, v in headers if k.lower() not in own)
        return span, kept + tuple(own.items())

    @staticmethod
    def end(span: Span, error: str | None = None) -> None:
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def close(self) -> None:
        """Send what is still batched, then stop."""
        self.provider.shutdown()


@dataclass(frozen=True)
class _Chunk:
    began: float
    ended: float
    start: int  # position of its first token in the request's context
    num_tokens: int
    batch_size: int  # requests in the step that ran it


@dataclass(eq=False)
class _Trace:
    parent: Context
    chunks: list[_Chunk] = field(default_factory=list)
    loads: list[TierLoad] = field(default_factory=list)
    decode_began: float | None = None
    decode_steps: int = 0
    # Set when it finishes (perf_counter times, as the request keeps them):
    attributes: dict[str, str | int] = field(default_factory=dict)
    arrival: float = 0.0
    first_token: float | None = None
    finish: float = 0.0
    error: str | None = None


class RequestTracer:
    """Each traced request's timeline while it runs, then its spans (the module docstring lists them).

    The loop's thread only notes times; the spans are made on a thread of their own (``radixserve-tracing``),
    so a finished request costs the scheduler a queue put, not the SDK's span bookkeeping.
    """

    def __init__(self, tracing: Tracing, attributes: Mapping[str, str]) -> None:
        """``attributes``: set on every request span (the policies, the replica)."""
        self.tracing = tracing
        self.attributes = dict(attributes)
        self._live: dict[int, _Trace] = {}
        self._offset_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> the epoch, as spans want
        self._finished: queue.SimpleQueue[_Trace | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._emit_all, name="radixserve-tracing", daemon=True)
        self._thread.start()

    def begin(self, requests: Sequence[Request], headers: Mapping[str, str]) -> None:
        """Trace ``requests`` (call it before submitting them), children of the caller's ``traceparent``."""
        parent = self.tracing.extract(headers)
        for req in requests:
            self._live[req.rid] = _Trace(parent)

    def on_batch(self, batch: ScheduledBatch, began: float, ended: float) -> None:
        for entry in batch.entries:
            trace = self._live.get(entry.req.rid)
            if trace is None:
                continue
            if entry.mode != "extend":  # a decode, or a decode verifying drafts
                trace.decode_steps += 1
                trace.decode_began = began if trace.decode_began is None else trace.decode_began
                continue
            load = entry.req.kv.tier_load if entry.req.kv is not None else None
            if load is not None and not (trace.loads and trace.loads[-1] is load):
                trace.loads.append(load)
            num_tokens = len(entry.new_token_ids)
            start = len(entry.context_slots) - num_tokens
            trace.chunks.append(_Chunk(began, ended, start, num_tokens, len(batch.entries)))

    def on_finish(self, req: Request, result: GenerateResult) -> None:
        trace = self._live.pop(req.rid, None)
        if trace is None or req.finish_time is None:
            return
        trace.attributes = {**self.attributes, **request_attributes(req, result)}
        trace.arrival, trace.first_token, trace.finish = req.arrival_time, req.first_token_time, req.finish_time
        trace.error = result.error
        self._finished.put(trace)

    def close(self) -> None:
        """Make the spans of every finished request, send them, stop."""
        self._finished.put(None)
        self._thread.join()
        self.tracing.close()

    def _emit_all(self) -> None:
        while (trace := self._finished.get()) is not None:
            self._emit(trace)

    def _emit(self, trace: _Trace) -> None:
        root = self.tracing.tracer.start_span(
            "radixserve.request", trace.parent, SpanKind.SERVER, trace.attributes, start_time=self._ns(trace.arrival)
        )
        inside = set_span_in_context(root)
        starts = [c.began for c in trace.chunks] + [load.began for load in trace.loads]
        self._child(inside, "radixserve.queue", trace.arrival, min(starts, default=trace.finish), {})
        for load in trace.loads:
            tokens = {f"radixserve.tier.{tier}_tokens": n for tier, n in load.num_tokens.items()}
            self._child(inside, "radixserve.tier_load", load.began, load.ended, tokens)
        for i, chunk in enumerate(trace.chunks):
            attributes = {
                "radixserve.chunk.index": i,
                "radixserve.chunk.start": chunk.start,
                "radixserve.chunk.tokens": chunk.num_tokens,
                "radixserve.batch.size": chunk.batch_size,
            }
            self._child(inside, "radixserve.prefill", chunk.began, chunk.ended, attributes)
        if trace.decode_began is not None:
            steps = {"radixserve.decode.steps": trace.decode_steps}
            self._child(inside, "radixserve.decode", trace.decode_began, trace.finish, steps)
        if trace.first_token is not None:
            root.add_event("first_token", timestamp=self._ns(trace.first_token))
        if trace.error is not None:
            root.set_status(Status(StatusCode.ERROR, trace.error))
        root.end(self._ns(trace.finish))

    def _child(self, parent: Context, name: str, began: float, ended: float, attributes: Attributes) -> None:
        span = self.tracing.tracer.start_span(name, parent, attributes=attributes, start_time=self._ns(began))
        span.end(self._ns(max(began, ended)))

    def _ns(self, perf_counter_s: float) -> int:
        return self._offset_ns + int(perf_counter_s * 1e9)


def request_attributes(req: Request, result: GenerateResult) -> dict[str, str | int]:
    return {
        "radixserve.request_id": req.rid,
        "gen_ai.usage.input_tokens": result.prompt_tokens,
        "gen_ai.usage.output_tokens": len(result.output_ids),
        "radixserve.cached_tokens": result.cached_tokens,
        "radixserve.finish_reason": result.finish_reason,
        "radixserve.retractions": req.num_retractions,
    }
