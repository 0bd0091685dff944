"""Two tiny-model engine replicas on a local Ray cluster, behind the front and the cache-aware router.

The test process is the Ray driver: it deploys the same application ``radixserve
serve --replicas 2`` deploys, talks to it over HTTP, and kills replicas (and the
front) through Ray to check that the router's view of each replica is rebuilt
from the replicas' KV-event snapshots.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from radixserve.engine import EngineConfig  # noqa: E402
from radixserve.router.deployments import APP_NAME, build_application  # noqa: E402
from radixserve.server.args import ServerArgs  # noqa: E402
from tests.support.server_process import free_port  # noqa: E402
from tests.support.tiny_model import build_engine_folder  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
# Deadlines, not expected durations: CI runs this beside other jobs on two cores, where a
# 16-request burst of 1,500 tokens each can take minutes. Every wait is on a condition.
CALL_TIMEOUT = 300.0  # one HTTP call
BURST_TIMEOUT = 900.0  # the whole burst
WAIT_TIMEOUT = 300.0  # a condition (replicas up, idle, rebuilt)
WORDS = " ".join(f"w{i % 97}" for i in range(200))  # a 200-token preamble for the word tokenizer


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = build_engine_folder(tmp_path_factory.mktemp("long") / MODEL, max_position_embeddings=4096)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = ServerArgs(
            engine=EngineConfig(model_path=str(model), max_total_tokens=8192),
            replicas=2,
            router_abs_threshold=3,
            router_rel_threshold=1.5,
            log_level="warning",
        )
        serve.run(build_application(args, replica_cpus=1.0), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: len(router(url)["replicas"]) == 2, "two replicas in the router")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for(check: Callable[[], Any], what: str, timeout: float = WAIT_TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout} s (last error: {last!r})")


def router(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/router", timeout=CALL_TIMEOUT)
    response.raise_for_status()
    out: dict[str, Any] = response.json()
    return out


def routed(url: str) -> dict[str, int]:
    return {r["replica"]: r["routed"] for r in router(url)["replicas"]}


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=CALL_TIMEOUT)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def went_to(url: str, send: Callable[[], Any]) -> tuple[str, Any]:
    """Which replica ``send`` (one routed call) went to, and what it returned."""
    before = routed(url)
    result = send()
    after = routed(url)
    moved = [r for r in after if after[r] != before.get(r, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0], result


def caches(url: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(url + "/cache", params={"check": "true"}, timeout=CALL_TIMEOUT)
    assert response.status_code == 200, response.text
    out: dict[str, dict[str, Any]] = response.json()["replicas"]
    return out


def flush(url: str) -> None:
    response = httpx.post(url + "/flush_cache", timeout=CALL_TIMEOUT)
    assert response.status_code == 200, response.text
    assert all(answer["flushed"] for answer in response.json()["replicas"].values())


def idle(url: str) -> bool:
    return all(
        c["running_requests"] == c["waiting_requests"] == c["protected_tokens"] == c["live_request_tokens"] == 0
        and c["invariants"] == "ok"
        for c in caches(url).values()
    )


def kill_actor(full_id: str) -> None:
    """Kill a Serve replica's actor (its name is the replica's full id); Serve starts a new one."""
    ray.kill(ray.get_actor(full_id, namespace="serve"), no_restart=True)


def test_a_shared_prefix_sticks_to_the_replica_that_holds_it(front: str) -> None:
    flush(front)
    first, out = went_to(front, lambda: complete(front, f"{WORDS} question 0"))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for i in range(1, 6):
        replica, out = went_to(front, lambda i=i: complete(front, f"{WORDS} question {i}"))
        assert replica == first
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 200
    state = router(front)
    assert state["decisions"].get("prefix", 0) >= 5
    holder = next(r for r in state["replicas"] if r["replica"] == first)
    assert holder["index"]["kind"] == "precise" and holder["index"]["blocks"] >= 200 // 16
    assert idle(front)


def test_an_imbalanced_burst_spills_to_the_other_replica(front: str) -> None:
    flush(front)
    home, _ = went_to(front, lambda: complete(front, f"{WORDS} warm"))
    before, balance_before = routed(front), router(front)["decisions"].get("balance", 0)

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=BURST_TIMEOUT) as client:
            body = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True}  # long enough to pile up
            calls = [
                client.post(front + "/v1/completions", json={**body, "prompt": f"{WORDS} burst {i}"}) for i in range(16)
            ]
            responses = await asyncio.wait_for(asyncio.gather(*calls), BURST_TIMEOUT)
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        return [r.json() for r in responses]

    results = asyncio.run(burst())
    after = routed(front)
    spread = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(spread.values()) == 16
    assert all(n > 0 for n in spread.values()), f"everything went to one replica: {spread}, {router(front)}"
    assert spread[home] > 3, f"the replica holding the prefix takes the first ones: {spread}"
    assert router(front)["decisions"].get("balance", 0) > balance_before
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in results) >= 12
    wait_for(lambda: idle(front), "replicas idle after the burst")


def test_a_client_leaving_mid_stream_aborts_on_the_replica(front: str) -> None:
    flush(front)
    body = {"model": MODEL, "prompt": f"{WORDS} long", "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", front + "/v1/completions", json=body, timeout=CALL_TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    wait_for(lambda: idle(front), "the abandoned stream aborted on its replica")
    # Finished, it would have cached ~3,700 tokens; aborted at once, little more than its prompt.
    cached = sum(c["cached_tokens"] for c in caches(front).values())
    assert cached < 1500, f"the request ran on after the client left ({cached} tokens cached)"


def test_bad_input_gets_the_single_server_errors_and_changes_nothing(front: str) -> None:
    wait_for(lambda: idle(front), "idle")
    before = caches(front)
    wrong_model = httpx.post(front + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=CALL_TIMEOUT)
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    not_json = httpx.post(front + "/v1/chat/completions", content=b"{nope", timeout=CALL_TIMEOUT)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    no_messages = httpx.post(front + "/v1/chat/completions", json={"model": MODEL}, timeout=CALL_TIMEOUT)
    assert no_messages.status_code == 400
    too_long = httpx.post(front + "/generate", json={"input_ids": [1] * 100_000}, timeout=CALL_TIMEOUT)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    after = caches(front)
    for replica, state in before.items():
        for field in ("cached_tokens", "free_tokens", "nodes", "protected_tokens"):
            assert after[replica][field] == state[field], (replica, field)


def test_fanned_out_endpoints_answer_for_every_replica(front: str) -> None:
    info = httpx.get(front + "/server_info", timeout=CALL_TIMEOUT).json()["replicas"]
    assert len(info) == 2 and all(answer["engine"]["vocab_size"] > 0 for answer in info.values())
    metrics = httpx.get(front + "/metrics", timeout=CALL_TIMEOUT)  # the fixture's replicas run without --enable-metrics
    assert metrics.status_code == 404 and metrics.json()["error"]["code"] == "metrics_disabled"


def test_a_restarted_front_rebuilds_the_index_from_snapshots(front: str) -> None:
    flush(front)
    home, _ = went_to(front, lambda: complete(front, f"{WORDS} before the restart"))
    blocks = next(r["index"]["blocks"] for r in router(front)["replicas"] if r["replica"] == home)
    assert blocks > 0
    fronts = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Front#" in a["name"]]
    assert len(fronts) == 1
    kill_actor(fronts[0])

    def rebuilt() -> bool:  # a new front, a new router: it knows only what the snapshots say
        views = {r["replica"]: r["index"] for r in router(front)["replicas"]}
        return home in views and views[home].get("snapshots", 0) >= 1 and views[home]["blocks"] == blocks

    wait_for(rebuilt, "the new front's router rebuilt from the replicas' snapshots")
    assert router(front)["decisions"].get("prefix", 0) == 0  # nothing routed by prefix since the restart
    replica, out = went_to(front, lambda: complete(front, f"{WORDS} after the restart"))
    assert replica == home
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 200


def test_a_replica_killed_mid_stream_ends_its_stream_and_is_survived(front: str) -> None:
    """A replica killed (ray.kill: its process ends at once) while it streams: that stream ends with an error
    event and [DONE], not a cut body; Serve starts a new replica and the router follows it."""
    flush(front)
    home, _ = went_to(front, lambda: complete(front, f"{WORDS} on the doomed replica"))
    survivor = next(r for r in routed(front) if r != home)
    body = {"model": MODEL, "prompt": f"{WORDS} on the doomed replica", "max_tokens": 3500, "stream": True}
    before = routed(front)[home]
    with httpx.stream("POST", front + "/v1/completions", json={**body, "ignore_eos": True}, timeout=CALL_TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert routed(front)[home] == before + 1  # the stream follows its prefix to the replica about to die
        kill_actor(home)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
    assert rest[-1] == "[DONE]", rest[-3:]
    assert json.loads(rest[-2])["error"]["code"] == "replica_unavailable", rest[-3:]

    def replaced() -> bool:
        views = {r["replica"]: r["index"] for r in router(front)["replicas"]}
        return len(views) == 2 and home not in views and all(v.get("snapshots", 0) >= 1 for v in views.values())

    wait_for(replaced, "Serve replaced the killed replica and the router follows the new one")
    fresh = next(r for r in router(front)["replicas"] if r["replica"] not in (home, survivor))
    assert fresh["index"]["blocks"] == 0  # a new engine: its snapshot is empty, nothing of the old view is kept
    for i in range(4):
        out = complete(front, f"{WORDS} after the crash {i}")
        assert out["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: idle(front), "idle after the restart")
    assert len(caches(front)) == 2
