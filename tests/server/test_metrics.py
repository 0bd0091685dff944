"""/metrics, scraped with prometheus_client's parser: counters move by exactly the tokens served."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL
from tests.support.server_process import ServerProcess


def scrape(url: str) -> dict[str, float]:
    """Every sample by name (labels folded into the name as name{k=v})."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_counters_move_by_exactly_the_tokens_served(server: ServerProcess) -> None:
    before = scrape(server.url)
    body = {
        "model": MODEL,
        "prompt": " ".join(f"w{i}" for i in range(3, 33)),
        "max_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,
    }
    usages = []
    for prompt in (body["prompt"], body["prompt"] + " w77 w78"):
        out = httpx.post(server.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
        usages.append(out["usage"])
    after = scrape(server.url)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    p = "radixserve:"
    assert delta(before, after, p + "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) == 30 + 32
    assert delta(before, after, p + "generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 14
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert delta(before, after, p + "cached_tokens_total") == cached > 0
    assert delta(before, after, p + "requests_total{finish_reason=length}") == 2
    assert delta(before, after, p + "e2e_request_latency_seconds_count") == 2
    assert delta(before, after, p + "time_to_first_token_seconds_count") == 2
    assert delta(before, after, p + "inter_token_latency_seconds_count") == 2 * 6
    assert 0 < after[p + "cache_hit_rate"] <= 1
    assert after[p + "num_running_reqs"] == 0 and after[p + "num_waiting_reqs"] == 0
    for name in ("evicted_tokens_total", "retractions_total", "token_usage", "requests_total{finish_reason=abort}"):
        assert p + name in after


def test_hit_rate_gauge_is_the_window_of_finished_requests(tiny_model_dir: object) -> None:
    proc = ServerProcess(
        "--enable-metrics", "--hit-rate-window", "2", "--log-level", "warning", model_path=str(tiny_model_dir)
    ).start()
    try:
        body = {"input_ids": list(range(3, 23)), "sampling_params": {"max_new_tokens": 1}}
        runs = [httpx.post(proc.url + "/generate", json=body, timeout=60).json()["meta_info"] for _ in range(3)]
        assert [r["cached_tokens"] for r in runs] == [0, 19, 19]
        assert scrape(proc.url)["radixserve:cache_hit_rate"] == 19 / 20  # the cold one left the 2-request window
        assert httpx.get(proc.url + "/metrics").status_code == 200
    finally:
        proc.stop()
