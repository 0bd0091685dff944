"""``--otlp-traces-endpoint`` through ``--replicas 2``: the caller's trace goes through the front to the replica."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.support.server_process import ServerProcess

pytest.importorskip("ray")
pytest.importorskip("opentelemetry.sdk")
pytestmark = pytest.mark.slow
CALL_TIMEOUT = 120.0


def test_the_callers_trace_crosses_the_router_to_the_replica(tiny_model_dir: Path) -> None:
    with OTLPReceiver() as receiver:
        flags = ("--replicas", "2", "--otlp-traces-endpoint", receiver.endpoint, "--log-level", "warning")
        proc = ServerProcess(*flags, model_path=tiny_model_dir).start(timeout=600)
        try:
            deadline = time.monotonic() + 300  # /health answers once the front and one replica are up
            while len(replicas := httpx.get(proc.url + "/router", timeout=CALL_TIMEOUT).json().get("replicas", [])) < 2:
                assert time.monotonic() < deadline, "the second replica never came up"
                time.sleep(0.2)
            names = {r["replica"] for r in replicas}
            callers = {}
            for i in range(1, 4):
                trace_id, span_id = f"{i:032x}", f"{i + 7:016x}"
                body = {"model": "tiny-llama", "prompt": f"w{i} w{i + 1} w{i + 2} w{i + 3}", "max_tokens": 3}
                headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
                reply = httpx.post(proc.url + "/v1/completions", json=body, headers=headers, timeout=CALL_TIMEOUT)
                assert reply.status_code == 200, reply.text
                callers[trace_id] = span_id

            def complete(spans: list[ReceivedSpan]) -> bool:
                kinds = {(s.trace_id, s.name) for s in spans}
                return all((t, n) in kinds for t in callers for n in ("radixserve.route", "radixserve.request"))

            spans = receiver.wait_for(complete, "route and request spans of every call")
        finally:
            code = proc.stop(signal.SIGINT, timeout=120)
    assert code == 0, proc.log()[-3000:]
    for trace_id, caller in callers.items():
        (route,) = [s for s in spans if s.trace_id == trace_id and s.name == "radixserve.route"]
        (request,) = [s for s in spans if s.trace_id == trace_id and s.name == "radixserve.request"]
        assert route.parent_span_id == caller and request.parent_span_id == route.span_id
        assert (
            route.attributes["http.response.status_code"] == 200 and route.attributes["url.path"] == "/v1/completions"
        )
        assert request.attributes["radixserve.replica"] in names, (request.attributes, names)
        assert route.start_ns <= request.start_ns and request.end_ns <= route.end_ns
        children = {s.name for s in spans if s.parent_span_id == request.span_id}
        assert {"radixserve.queue", "radixserve.prefill", "radixserve.decode"} <= children
