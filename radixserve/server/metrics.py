"""Prometheus metrics (``--enable-metrics``, served at ``/metrics``), prefix ``radixserve:``.

Counters count what was served, at the moment a request finishes (whatever the
reason: the tokens of an aborted request were still computed or read):

    radixserve:prompt_tokens_total        prompt tokens of finished requests
    radixserve:cached_tokens_total        of those, served from the prefix cache
    radixserve:generation_tokens_total    tokens generated
    radixserve:requests_total{finish_reason=stop|length|abort}
    radixserve:evicted_tokens_total       KV slots the cache evicted
    radixserve:retractions_total          running requests stepped back for memory

``radixserve:cache_hit_rate`` is cached / prompt tokens over the last
``--hit-rate-window`` finished requests (default 1,000), weighted by tokens. It
moves only when a request finishes, so an idle server keeps its last value and
one odd batch cannot overwrite it. For an exact rate over any time range use the
counters: ``rate(radixserve:cached_tokens_total[5m]) / rate(radixserve:prompt_tokens_total[5m])``.

Gauges ``num_running_reqs``, ``num_waiting_reqs`` and ``token_usage`` (share of KV
slots held by live requests, not reclaimable by eviction) are set after every
scheduler step. Histograms: ``time_to_first_token_seconds`` (arrival at the
server to first token), ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``.
``cache_config_info{prefix_cache, eviction_policy, schedule_policy, page_size, kv_cache_dtype}`` is 1: its
labels say how the cache is set up (join on it to group other series by policy). ``kv_cache_tokens_per_gib``:
what one GiB of the KV pool holds in its dtype (an int8 pool's scales included).

Thread-safety: the scheduler thread updates, the HTTP thread renders;
prometheus_client's metrics are thread-safe, and the window sums are changed
under one lock.
"""

from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "radixserve:"
FINISH_REASONS = ("stop", "length", "abort")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TOKEN_GAP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)


class ServerMetrics:
    def __init__(
        self, hit_rate_window: int = 1000, cache_config: dict[str, str] | None = None, kv_tokens_per_gib: int = 0
    ) -> None:
        self.registry = registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.evicted_tokens = counter("evicted_tokens", "KV slots evicted from the prefix cache.")
        self.retractions = counter("retractions", "Running requests retracted for lack of KV memory.")
        # vLLM's speculative decoding counters (of finished requests; drafts verified, and of those accepted)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified (speculative).")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative).")
        self.requests = counter("requests", "Finished requests by finish reason.", ("finish_reason",))
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self.cache_hit_rate = gauge(
            "cache_hit_rate", f"Cached / prompt tokens over the last {hit_rate_window} finished requests."
        )
        self.num_running = gauge("num_running_reqs", "Requests admitted (prefilling or decoding).")
        self.num_waiting = gauge("num_waiting_reqs", "Requests in the waiting queue.")
        self.token_usage = gauge("token_usage", "Share of KV slots held by live requests.")
        tokens_per_gib = gauge("kv_cache_tokens_per_gib", "Tokens one GiB of the KV pool holds in its dtype.")
        tokens_per_gib.set(kv_tokens_per_gib)
        config = cache_config or {}
        info = Gauge(
            PREFIX + "cache_config_info", "How the prefix cache is set up (1).", tuple(config), registry=registry
        )
        if config:
            info.labels(**config).set(1)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)

        self._lock = threading.Lock()
        self._window: deque[tuple[int, int]] = deque()
        self._window_size = hit_rate_window
        self._window_prompt = self._window_cached = 0
        self._seen_evicted = self._seen_retractions = 0

    def on_finish(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        generated: int,
        reason: str,
        e2e: float,
        spec: tuple[int, int] | None = None,
    ) -> None:
        """``spec``: (draft tokens verified, accepted) when the request drafted."""
        self.prompt_tokens.inc(prompt_tokens)
        if spec is not None:
            self.spec_draft_tokens.inc(spec[0])
            self.spec_accepted_tokens.inc(spec[1])
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(generated)
        self.requests.labels(finish_reason=reason).inc()
        self.e2e.observe(e2e)
        with self._lock:
            self._window.append((prompt_tokens, cached_tokens))
            self._window_prompt += prompt_tokens
            self._window_cached += cached_tokens
            if len(self._window) > self._window_size:
                old_prompt, old_cached = self._window.popleft()
                self._window_prompt -= old_prompt
                self._window_cached -= old_cached
            rate = self._window_cached / self._window_prompt if self._window_prompt else 0.0
        self.cache_hit_rate.set(rate)

    def on_step(self, num_running: int, num_waiting: int, token_usage: float, evicted: int, retractions: int) -> None:
        """After each scheduler step: gauges, and the counters' growth since the last step."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.token_usage.set(token_usage)
        if evicted > self._seen_evicted:
            self.evicted_tokens.inc(evicted - self._seen_evicted)
        if retractions > self._seen_retractions:
            self.retractions.inc(retractions - self._seen_retractions)
        self._seen_evicted, self._seen_retractions = evicted, retractions

    def render(self) -> bytes:
        return generate_latest(self.registry)
