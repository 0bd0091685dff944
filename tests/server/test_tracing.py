"""``--otlp-traces-endpoint``: one trace per request, sent to a collector (a small OTLP/HTTP receiver here).

A launched server with chunked prefill and cache tiers: the request span is the caller's
``traceparent``'s child, its children are the queue, each prefill chunk, the decode and (for a
prompt evicted to L2 and loaded back) the tier load, each with its attributes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from tests.server.conftest import MODEL  # noqa: E402
from tests.support.otlp_receiver import OTLPReceiver, ReceivedSpan  # noqa: E402
from tests.support.server_process import ServerProcess  # noqa: E402

CHUNK = 64
CALL_TIMEOUT = 120.0
CHILDREN = {"radixserve.queue", "radixserve.tier_load", "radixserve.prefill", "radixserve.decode"}


def words(start: int, count: int) -> str:
    return " ".join(f"w{i % 90}" for i in range(start, start + count))


def traceparent(n: int) -> tuple[str, str, str]:
    """A caller's ``traceparent`` header, its trace id and its span id."""
    trace_id, span_id = f"{n:032x}", f"{n + 7:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, OTLPReceiver]]:
    flags = ("--max-total-tokens", "512", "--page-size", "16", "--chunked-prefill-size", str(CHUNK))
    tiers = ("--hicache-size", "0.001", "--cache-dir", str(tmp_path_factory.mktemp("l3")))
    with OTLPReceiver() as receiver:
        server = ServerProcess(
            *flags,
            *tiers,
            "--otlp-traces-endpoint",
            receiver.endpoint,
            "--log-level",
            "warning",
            model_path=tiny_model_dir,
        )
        with server:
            yield server.url, receiver


def complete(url: str, prompt: str, header: str | None = None, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    headers = {"traceparent": header} if header else {}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=CALL_TIMEOUT)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def request_trace(receiver: OTLPReceiver, trace_id: str) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The request span of ``trace_id`` and its children, once they all came."""

    def done(spans: list[ReceivedSpan]) -> bool:
        return any(s.name == "radixserve.request" and s.trace_id == trace_id for s in spans)

    spans = [s for s in receiver.wait_for(done, f"the request span of trace {trace_id}") if s.trace_id == trace_id]
    (root,) = [s for s in spans if s.name == "radixserve.request"]
    children = [s for s in spans if s.parent_span_id == root.span_id]
    assert {s.name for s in children} <= CHILDREN and len(children) == len(spans) - 1, spans
    return root, children


def check_timeline(root: ReceivedSpan, children: list[ReceivedSpan], usage: dict[str, Any]) -> None:
    """Queue, then the prefill chunks back to back over the uncached prompt, then the decode; all inside the root."""
    for child in children:
        assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns, child
    (queue,) = [s for s in children if s.name == "radixserve.queue"]
    chunks = sorted((s for s in children if s.name == "radixserve.prefill"), key=lambda s: s.start_ns)
    (decode,) = [s for s in children if s.name == "radixserve.decode"]
    assert queue.start_ns == root.start_ns and queue.end_ns <= chunks[0].start_ns
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    position = cached
    for i, chunk in enumerate(chunks):
        a = chunk.attributes
        assert (a["radixserve.chunk.index"], a["radixserve.chunk.start"]) == (i, position), chunks
        assert 0 < a["radixserve.chunk.tokens"] <= CHUNK and a["radixserve.batch.size"] >= 1
        position += a["radixserve.chunk.tokens"]
    assert position == usage["prompt_tokens"]
    assert all(a.end_ns <= b.start_ns for a, b in zip(chunks, chunks[1:]))
    assert decode.start_ns >= chunks[-1].end_ns and decode.end_ns == root.end_ns
    assert decode.attributes["radixserve.decode.steps"] == usage["completion_tokens"] - 1
    a = root.attributes
    assert a["radixserve.cached_tokens"] == cached and a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] and a["radixserve.finish_reason"] == "length"
    assert (a["radixserve.eviction_policy"], a["radixserve.schedule_policy"]) == ("lru", "fcfs")
    assert "radixserve.replica" not in a and root.service == "radixserve" and "first_token" in root.events


def test_a_request_span_continues_the_callers_trace(traced: tuple[str, OTLPReceiver]) -> None:
    url, receiver = traced
    header, trace_id, span_id = traceparent(1)
    out = complete(url, words(0, 150), header)
    root, children = request_trace(receiver, trace_id)
    assert root.parent_span_id == span_id
    assert len([s for s in children if s.name == "radixserve.prefill"]) == -(-out["usage"]["prompt_tokens"] // CHUNK)
    assert not [s for s in children if s.name == "radixserve.tier_load"]
    check_timeline(root, children, out["usage"])


def test_a_prompt_loaded_back_from_the_tiers_has_a_tier_load_span(traced: tuple[str, OTLPReceiver]) -> None:
    url, receiver = traced
    complete(url, words(3, 150), traceparent(2)[0])
    for i in range(1, 5):  # push it out of the 512-token pool into L2
        complete(url, words(11 * i, 150))
    header, trace_id, _ = traceparent(3)
    out = complete(url, words(3, 150), header)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    root, children = request_trace(receiver, trace_id)
    (load,) = [s for s in children if s.name == "radixserve.tier_load"]
    loaded = load.attributes.get("radixserve.tier.host_tokens", 0) + load.attributes.get(
        "radixserve.tier.disk_tokens", 0
    )
    assert loaded > 0 and loaded % 16 == 0
    (queue,) = [s for s in children if s.name == "radixserve.queue"]
    assert queue.end_ns <= load.start_ns
    check_timeline(root, children, out["usage"])
    # the requests sent without a traceparent each began a trace of their own
    roots = [s for s in receiver.spans() if s.name == "radixserve.request" and not s.parent_span_id]
    assert len({s.trace_id for s in roots}) >= 4


NO_SDK = """
import sys
for name in ("opentelemetry.sdk", "opentelemetry.exporter"):  # as if the tracing extra were not installed
    sys.modules[name] = None
from radixserve.server.args import parse_args
args = parse_args(["--model-path", sys.argv[1]])
from fastapi.testclient import TestClient
from radixserve.engine import Engine
from radixserve.server.app import create_app
with TestClient(create_app(Engine(args.engine), args)) as client:
    body = {"model": "tiny-llama", "prompt": "w1 w2 w3", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
parse_args(["--model-path", sys.argv[1], "--otlp-traces-endpoint", "http://127.0.0.1:4318"])
"""


def test_without_the_sdk_the_server_runs_and_the_flag_says_what_to_install(tiny_model_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", NO_SDK, str(tiny_model_dir)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2, done.stderr[-3000:]  # served a request, then the flag was a usage error
    assert "pip install 'radixserve[tracing]'" in done.stderr and "--otlp-traces-endpoint" in done.stderr


def test_an_endpoint_that_is_not_a_url_is_a_usage_error() -> None:
    from radixserve.server.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--otlp-traces-endpoint", "localhost:4318"])
    assert exc.value.code == 2


# ---- in-process: the engine's loop, the tracer and the SDK's in-memory exporter ---------------------------------


def test_aborted_requests_end_their_spans(tiny_model_dir: Path) -> None:
    """Aborted mid-decode: the decode span ends with the request. Aborted while queued: only a queue span.
    Aborted by the server's shutdown: the request span's status is the error."""
    import queue
    import threading

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from radixserve.engine import Engine
    from radixserve.engine.driver import Delta
    from radixserve.server.tracing import RequestTracer, Tracing
    from radixserve.server.worker import ServerListener

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(Tracing(provider), {"radixserve.eviction_policy": "lru"})
    engine = Engine(model_path=str(tiny_model_dir), max_total_tokens=512)
    stopping = threading.Event()
    loop = threading.Thread(target=engine.run_forever, args=(stopping, ServerListener(None, None, tracer)))
    loop.start()
    deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
    decoding, queued, cut = (
        engine.make_request(list(range(3 + i, 40)), {"max_new_tokens": 200, "ignore_eos": True}) for i in range(3)
    )
    results = {}

    def until(done: Callable[[], bool]) -> None:
        while not done():
            delta = deltas.get(timeout=120)
            if delta.result is not None:
                results[delta.rid] = delta.result

    try:
        tracer.begin([decoding, queued, cut], {})
        engine.submit(decoding, deltas.put)
        until(lambda: len(decoding.output_ids) >= 3)
        engine.abort(decoding.rid)
        # Both queued from the loop's own thread: its inbox runs them in one turn, before any step.
        engine.call(lambda: (engine.submit(queued, deltas.put), engine.abort(queued.rid))).result(120)
        engine.submit(cut, deltas.put)
        until(lambda: len(cut.output_ids) >= 1 and len(results) == 2)
    finally:
        stopping.set()  # the shutdown aborts ``cut`` with an error
        engine.call(lambda: None)
        loop.join(120)
        tracer.close()
    until(lambda: len(results) == 3)
    assert {r.finish_reason for r in results.values()} == {"abort"} and results[cut.rid].error is not None
    spans = exporter.get_finished_spans()
    roots = {s.attributes["radixserve.request_id"]: s for s in spans if s.name == "radixserve.request"}
    assert set(roots) == {decoding.rid, queued.rid, cut.rid}

    def children(rid: int) -> dict[str, Any]:
        root = roots[rid].context.span_id
        return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root}

    assert set(children(decoding.rid)) == {"radixserve.queue", "radixserve.prefill", "radixserve.decode"}
    assert children(decoding.rid)["radixserve.decode"].end_time == roots[decoding.rid].end_time
    assert set(children(queued.rid)) == {"radixserve.queue"}
    for rid in (decoding.rid, queued.rid):
        assert roots[rid].status.status_code is StatusCode.UNSET
        assert roots[rid].attributes["radixserve.finish_reason"] == "abort"
    assert roots[cut.rid].status.status_code is StatusCode.ERROR
    assert roots[cut.rid].status.description == results[cut.rid].error
