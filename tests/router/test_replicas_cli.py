"""``radixserve serve --replicas 2`` as users run it: a local Ray cluster, the OpenAI API, the caller's trace
through the front to the replica (``--otlp-traces-endpoint``), a clean stop. One server for the module: a
Ray cluster costs ~25 s to start."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.otlp_receiver import OTLPReceiver, ReceivedSpan
from tests.support.server_process import ServerProcess

pytest.importorskip("ray")
pytest.importorskip("opentelemetry.sdk")
pytestmark = pytest.mark.slow
CALL_TIMEOUT = 120.0
STEP_SPANS = ("radixserve.queue", "radixserve.prefill", "radixserve.decode")  # a request span's children


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, OTLPReceiver, list[dict[str, Any]]]]:
    """The server, the OTLP receiver its spans go to, and the replicas the router lists (both up)."""
    with OTLPReceiver() as receiver:
        flags = ("--replicas", "2", "--otlp-traces-endpoint", receiver.endpoint, "--log-level", "warning")
        proc = ServerProcess(*flags, model_path=tiny_model_dir).start(timeout=600)
        try:
            deadline = time.monotonic() + 300  # /health answers once the front and one replica are up
            while len(replicas := httpx.get(proc.url + "/router", timeout=CALL_TIMEOUT).json().get("replicas", [])) < 2:
                assert time.monotonic() < deadline, "the second replica never came up"
                time.sleep(0.2)
            yield proc, receiver, replicas
        finally:
            code = proc.stop(signal.SIGINT, timeout=120)  # Ctrl-C: drain, delete the app, stop the local cluster
    assert code == 0, proc.log()[-3000:]


def test_serve_replicas_from_the_command_line(served: tuple[ServerProcess, OTLPReceiver, list]) -> None:
    from openai import OpenAI

    proc = served[0]
    client = OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(3, 90))}
    usages = []
    for question in ("w5 w6", "w7 w8", "w9 w10"):
        reply = client.chat.completions.create(
            model="tiny-llama",
            max_tokens=4,
            extra_body={"ignore_eos": True},
            messages=[system, {"role": "user", "content": question}],
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        usages.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert usages[0] == 0 and all(cached >= 80 for cached in usages[1:]), usages  # one replica kept the prefix
    state = httpx.get(proc.url + "/router", timeout=CALL_TIMEOUT).json()
    assert state["policy"] == "cache-aware" and len(state["replicas"]) == 2
    assert state["decisions"].get("prefix") == 2  # the second and third chats followed the first


def test_the_callers_trace_crosses_the_router_to_the_replica(served: tuple[ServerProcess, OTLPReceiver, list]) -> None:
    proc, receiver, replicas = served
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
        """Every call's route and request spans, and the request's queue / prefill / decode children (the
        replica's exporter may send them in a later batch than the request span)."""
        kinds = {(s.trace_id, s.name) for s in spans}
        if not all((t, n) in kinds for t in callers for n in ("radixserve.route", "radixserve.request")):
            return False
        requests = {s.span_id for s in spans if s.name == "radixserve.request" and s.trace_id in callers}
        children = {(s.parent_span_id, s.name) for s in spans}
        return all((r, n) in children for r in requests for n in STEP_SPANS)

    spans = receiver.wait_for(complete, "route, request and step spans of every call")
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
        assert set(STEP_SPANS) <= children
