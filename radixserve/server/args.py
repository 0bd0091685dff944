"""``radixserve serve`` flags: named as SGLang users know them, resolved into one ServerArgs.

The engine's own options keep the engine's defaults (``EngineConfig``); the rest
shape the HTTP server. ``ServerArgs.resolved()`` is what the server logs at start
and serves at ``/server_info``: the chapter's first debugging advice is "check
the resolved server args" (a cache silently turned off shows there).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from radixserve.cache import EVICTION_POLICIES, PREFIX_CACHES, WRITE_POLICIES
from radixserve.core import ROUTER_INDEXES, ROUTER_POLICIES
from radixserve.engine import DTYPES, EngineConfig
from radixserve.engine.config import ENGINE_OPTIONS, SPECULATIVE_ALGORITHMS
from radixserve.kv_events.config import KVEventsConfig, parse_kv_events_config
from radixserve.model.invariance import INVARIANT_KERNELS
from radixserve.model.paged_kernel import ATTENTION_BACKENDS
from radixserve.model.precision import KV_CACHE_DTYPES
from radixserve.model.quant import QUANTIZATIONS
from radixserve.scheduler.draft import SPEC_SOURCES
from radixserve.scheduler.policy import SCHEDULE_POLICIES
from radixserve.server.reasoning import REASONING_PARSERS
from radixserve.server.tool_parsers import PARSERS

DEFAULT_PORT = 30000
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerArgs:
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_model_name: str | None = None  # None: the model file or folder name
    tool_call_parser: str | None = None  # None: chosen from the chat template (server/tools.py)
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None
    admin_api_key: str | None = None
    tenant_header: str | None = None
    tenant_isolation: bool = False
    kv_events_endpoint: str | None = None  # ZMQ PUB endpoint for KV events (off when None)
    kv_events_replay_endpoint: str | None = None  # None: the next port (tcp) or <path>.replay (ipc)
    kv_events_block_size: int = 16
    kv_events_topic: str = ""  # the first frame of every message (SUB sockets filter on it)
    kv_events_buffer_steps: int = 10_000  # batches the replay socket keeps
    kv_events_hwm: int = 100_000
    shared_prefixes: tuple[str, ...] = ()  # raw text prompt heads shared across namespaces
    shared_system_prompts: tuple[str, ...] = ()  # system messages (through the chat template) shared likewise
    enable_metrics: bool = False
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for request traces (off when None)
    reasoning_parser: str | None = None  # <think>...</think> into reasoning_content (server/reasoning.py)
    hit_rate_window: int = 1000  # finished requests the cache_hit_rate gauge averages over
    max_queued_requests: int = 4096  # requests in flight (queued + running) before new ones get 503
    max_request_bytes: int = 8 << 20  # a POST body beyond this is a 413, refused before it is parsed
    max_header_bytes: int = 64 << 10  # a request head (line + headers) beyond this is a 400, connection closed
    header_timeout: float = 10.0  # seconds a connection gets to send a complete request head
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open after a response
    max_connections: int = 0  # open connections at once (0: the descriptor limit less some headroom)
    graceful_shutdown_timeout: float = 30.0
    log_level: str = "info"
    # Scale-out (Ray Serve): 0 = this process only
    replicas: int = 0
    ray_address: str | None = None  # None: start a local Ray cluster
    router: str = "cache-aware"
    router_index: str = "precise"
    router_abs_threshold: int = 8
    router_rel_threshold: float = 1.5
    replica_cpus: float | None = None  # None: min(1, cluster CPUs / replicas)

    def __post_init__(self) -> None:
        """Every check here, so a ServerArgs built without flags (the Ray path, tests) is checked too."""
        problems = [message for ok, message in self._checks() if not ok]
        if self.otlp_traces_endpoint:
            problems += tracing_problems(self.otlp_traces_endpoint)
        if problems:
            raise ValueError("; ".join(problems))
        # One fact: KV events are on when they have an endpoint to go to. The engine's event log follows it,
        # so an endpoint never publishes nothing, and no log fills up that nobody drains.
        publish = bool(self.kv_events_endpoint)
        if self.engine.enable_kv_events != publish:
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, enable_kv_events=publish))

    def _checks(self) -> list[tuple[bool, str]]:
        identified = bool(self.api_keys or self.api_key_file or self.tenant_header)
        return [
            (self.kv_events_block_size >= 1, "--kv-events-block-size must be >= 1"),
            (
                not self.tenant_isolation or identified,
                "--tenant-isolation needs identities: --api-key, --api-key-file or --tenant-header",
            ),
            (
                self.replicas >= 0 and self.router_abs_threshold >= 0 and self.router_rel_threshold >= 1,
                "--replicas and --router-abs-threshold must be >= 0, --router-rel-threshold >= 1",
            ),
            (self.replica_cpus is None or self.replica_cpus >= 0, "--replica-cpus must be >= 0"),
            (
                self.max_request_bytes >= 1024,
                f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}",
            ),
            (0 < self.port < 65536, f"--port must be in 1..65535, got {self.port}"),
            (
                self.max_header_bytes >= 1024 and self.header_timeout > 0 and self.keep_alive_timeout > 0,
                "--max-header-bytes must be >= 1024, --header-timeout and --keep-alive-timeout > 0",
            ),
            (self.max_connections >= 0, "--max-connections must be >= 0 (0: from the descriptor limit)"),
            (
                self.hit_rate_window >= 1 and self.max_queued_requests >= 1 and self.graceful_shutdown_timeout >= 0,
                "--hit-rate-window and --max-queued-requests must be >= 1, --graceful-shutdown-timeout >= 0",
            ),
            (self.router in ROUTER_POLICIES, f"--router must be one of {ROUTER_POLICIES}"),
            (self.router_index in ROUTER_INDEXES, f"--router-index must be one of {ROUTER_INDEXES}"),
            (self.log_level in LOG_LEVELS, f"--log-level must be one of {LOG_LEVELS}"),
            (
                self.reasoning_parser in (None, *REASONING_PARSERS),
                f"--reasoning-parser must be one of {tuple(REASONING_PARSERS)}",
            ),
            (
                self.tool_call_parser in (None, *PARSERS),
                f"--tool-call-parser must be one of {tuple(PARSERS)}",
            ),
        ]

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.engine.model_path is None:
            return "SmolLM2-135M-Instruct"
        return Path(self.engine.model_path).name.removesuffix(".gguf")

    def resolved(self) -> dict[str, Any]:
        """Every setting as it will be used; the API key only as whether one is set."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"}
        values["api_keys"] = f"<{len(self.api_keys)} set>" if self.api_keys else None
        values["admin_api_key"] = "<set>" if self.admin_api_key else None
        values["served_model_name"] = self.model_name()
        return {**values, **dataclasses.asdict(self.engine)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve serve",
        description="Serve a model over HTTP: OpenAI-compatible /v1 endpoints, the native /generate, "
        "/health, /server_info, /cache, /flush_cache and (with --enable-metrics) Prometheus /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = EngineConfig()
    _model_flags(parser.add_argument_group("model"), defaults)
    _cache_flags(parser.add_argument_group("prefix cache"), defaults)
    _scheduler_flags(parser.add_argument_group("scheduler"), defaults)
    server = parser.add_argument_group("server")
    _server_flags(server)
    _kv_event_flags(server)
    _tenancy_flags(parser.add_argument_group("tenants (see docs/server/security.md)"))
    _limit_flags(server)
    _scale_out_flags(parser.add_argument_group("scale-out on Ray Serve (see docs/scale-out.md)"))
    return parser


def _model_flags(model: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """Which model, on which device, in which dtype."""
    model.add_argument(
        "--model-path",
        default=None,
        help="HF folder (config.json + safetensors + tokenizer) or a .gguf file; "
        "default: the embedded SmolLM2-135M-Instruct GGUF",
    )
    model.add_argument(
        "--chat-template",
        default=None,
        metavar="PATH",
        help="a Jinja chat template file for /v1/chat/completions instead of the model's own "
        "(GGUF tokenizer.chat_template, chat_template.jinja or tokenizer_config.json)",
    )
    model.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(PARSERS),
        help="the format of the model's tool calls on /v1/chat/completions; default: from the chat template "
        "(<tool_call>: hermes, [TOOL_CALLS]: mistral, Llama 3 headers: llama3_json; a template without tools: "
        "hermes, with the tools in the system prompt)",
    )
    model.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: the file or folder name)"
    )
    model.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", *DTYPES],
        help="weights (and KV unless --kv-cache-dtype); auto = bfloat16 on CUDA, AMX or AVX512-BF16 CPUs, else fp32",
    )
    model.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV pool's dtype; auto = --dtype. bfloat16 under float32 weights: 2x tokens per GiB; int8 (one "
        "scale per token and head): 1.94x bfloat16's, lossy (docs: server/precision.md); fp8_e4m3 the same size, for "
        "CUDA (on CPU only with --attention-backend reference)",
    )
    model.add_argument(
        "--quantization",
        default=d.quantization,
        choices=["auto", *QUANTIZATIONS],
        help="weight-only; auto = q4_1-exact on a GGUF stored as Q4_0/Q4_1/Q8_0 blocks (CPU), else none; "
        "int8 = int8 weights with per-channel scales (~4x fewer weight bytes than float32); "
        "q4_1 = GGUF-style 4-bit blocks (a GGUF's own Q4_0/Q4_1/Q8_0 blocks kept as they are) "
        "with int8 activations, as llama.cpp; "
        "q4_1-exact = the same blocks with float activations (equals float32 on the GGUF)",
    )
    model.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="auto = paged (reads the KV pool in place; CPU, C++ kernel) where it builds, else reference (gather+SDPA)",
    )
    model.add_argument(
        "--split-invariant",
        action=argparse.BooleanOptionalAction,
        default=d.split_invariant,
        help="a token's logits never depend on how many rows share its step, so a cache hit never changes an "
        "answer (block linears run their own kernel at any row count); --no-split-invariant sends prefill rows "
        "to the vendor GEMM: faster prefill on AMX CPUs, but a cache hit can change a bfloat16 answer",
    )
    model.add_argument(
        "--split-invariant-kernel",
        default=d.split_invariant_kernel,
        choices=INVARIANT_KERNELS,
        help="the kernel split-invariant block linears run at every row count: vector (AVX512-BF16 dot products: "
        "decode at full speed, prefill ~0.2x the vendor GEMM on AMX CPUs) or amx (AMX tiles: prefill near the "
        "GEMM's speed, the linears' decode ~2x slower; needs AMX-BF16)",
    )
    model.add_argument("--device", default=d.device, help="auto (cuda when present), cpu, cuda or cuda:N")
    model.add_argument(
        "--num-threads",
        type=int,
        default=d.num_threads,
        help="torch CPU threads; 1 is safe on a busy machine (libgomp spins)",
    )


def _cache_flags(cache: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The prefix cache variant, its page and eviction policy, the KV pool size."""
    cache.add_argument(
        "--prefix-cache",
        default=d.prefix_cache,
        choices=PREFIX_CACHES,
        help="radix tree; block = 16-token hash blocks (vLLM-style); none = no reuse",
    )
    cache.add_argument("--disable-radix-cache", action="store_true", help="same as --prefix-cache none")
    cache.add_argument(
        "--page-size", type=int, default=d.page_size, help="tokens per KV page; matches round down to a whole page"
    )
    cache.add_argument(
        "--radix-eviction-policy",
        default=d.radix_eviction_policy,
        choices=sorted(EVICTION_POLICIES),
        help="which unlocked leaf is evicted first",
    )
    cache.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (default: a quarter of free memory, at most 32k on CPU)",
    )
    cache.add_argument(
        "--hicache-size",
        type=float,
        default=d.hicache_size,
        help="GiB of host memory (L2) that keeps pages the KV pool evicts; 0 = no host tier",
    )
    cache.add_argument(
        "--hicache-write-policy",
        default=d.hicache_write_policy,
        choices=WRITE_POLICIES,
        help="write_back: copy a page down when it is evicted; write_through: as soon as it is cached",
    )
    cache.add_argument(
        "--hicache-compress",
        action="store_true",
        help="store host-tier pages as int8 with per-page scales (~4x the tokens per GiB, lossy)",
    )
    cache.add_argument(
        "--cache-dir",
        default=d.cache_dir,
        help="directory of the disk tier (L3): pages survive restarts; bound to this model by a fingerprint",
    )
    cache.add_argument(
        "--cache-dir-size", type=float, default=d.cache_dir_size, help="GiB the disk tier may use (default: no limit)"
    )


def _scheduler_flags(sched: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The waiting queue's order and the per-step limits."""
    sched.add_argument(
        "--schedule-policy",
        default=d.schedule_policy,
        choices=SCHEDULE_POLICIES,
        help="order of the waiting queue; lpm = longest cached prefix first",
    )
    sched.add_argument(
        "--disable-in-batch-dedup",
        action="store_true",
        help="admit requests sharing an uncached prefix together instead of one first",
    )
    sched.add_argument("--schedule-seed", type=int, default=d.schedule_seed, help="seed of --schedule-policy random")
    sched.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help="prefill tokens per step; longer prompts are prefilled in chunks",
    )
    sched.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="run each prefill chunk in one forward with the running decodes, so decoders never wait a whole step",
    )
    sched.add_argument(
        "--max-running-requests", type=int, default=d.max_running_requests, help="requests decoded together"
    )
    sched.add_argument(
        "--speculative-algorithm",
        default=d.speculative_algorithm,
        choices=SPECULATIVE_ALGORITHMS,
        help="ngram: speculative decoding with no draft model: tokens that followed the last few tokens in the "
        "prefix cache or the request's own text are verified in the step's forward (off by default)",
    )
    sched.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=d.speculative_num_draft_tokens,
        help="the most tokens drafted for one request per step (adapted to its recent acceptance)",
    )
    sched.add_argument(
        "--speculative-ngram-source",
        default=d.speculative_ngram_source,
        choices=SPEC_SOURCES,
        help="where ngram drafts come from: the prefix cache's sequences (tree), the request's own text (prompt)",
    )
    sched.add_argument(
        "--speculative-row-cost",
        type=float,
        default=d.speculative_row_cost,
        help="a verify row's cost in decode steps, for pricing drafts (default: measured at start on this machine)",
    )


def _server_flags(server: argparse._ArgumentGroup) -> None:
    """Where to listen, who may call, metrics."""
    server.add_argument("--host", default=ServerArgs.host, help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port to listen on")
    server.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require `Authorization: Bearer KEY` (all endpoints but /health and /metrics); "
        "repeat for several keys: each is its own tenant, but they share one prefix cache unless "
        "--tenant-isolation (with several, /flush_cache and /cache's text are for --admin-api-key only)",
    )
    server.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    server.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send one OpenTelemetry trace per request (queue, prefill chunks, decode, tier loads) to this "
        "OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (/v1/traces is added to a URL without a path); "
        "a traceparent header makes it part of the caller's trace; needs pip install 'radixserve[tracing]'",
    )
    server.add_argument(
        "--reasoning-parser",
        default=None,
        choices=tuple(REASONING_PARSERS),
        help="chat answers' <think>...</think> into reasoning_content (structured output applies after it)",
    )


def _kv_event_flags(server: argparse._ArgumentGroup) -> None:
    """KV events for a router outside the process."""
    server.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish the cache's stored/removed blocks on this ZMQ PUB endpoint "
        "(e.g. tcp://127.0.0.1:5557); off by default",
    )
    server.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint for missed-batch replays and snapshots (default: the next port)",
    )
    server.add_argument(
        "--kv-events-config",
        default=None,
        help='KV events as vLLM and SGLang configure them, a JSON object: {"publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000, '
        '"hwm": 100000} (--kv-events-endpoint is a shorthand for its endpoint)',
    )
    server.add_argument(
        "--kv-events-block-size",
        type=int,
        default=ServerArgs.kv_events_block_size,
        help="tokens per block in KV events (whatever the cache's page size)",
    )


def _tenancy_flags(tenancy: argparse._ArgumentGroup) -> None:
    """Tenants: keys, namespaces, the prompt heads they share."""
    tenancy.add_argument("--api-key-file", default=None, help="API keys, one 'TENANT KEY' per line")
    tenancy.add_argument(
        "--admin-api-key", default=None, help="a key that may flush the cache and see every namespace in /cache"
    )
    tenancy.add_argument(
        "--tenant-header", default=None, help="take the tenant from this header (only behind a proxy that sets it)"
    )
    tenancy.add_argument(
        "--shared-system-prompt",
        action="append",
        default=[],
        help="a system prompt whose chat-template rendering every namespace shares (the rest "
        "of each conversation stays private); repeatable",
    )
    tenancy.add_argument(
        "--shared-prefix",
        action="append",
        default=[],
        help="a raw prompt prefix (text) every namespace shares; repeatable",
    )
    tenancy.add_argument(
        "--tenant-isolation",
        action="store_true",
        help="derive each request's cache namespace from its tenant: tenants never share a "
        "prefix, and a client's cache_salt cannot reach another tenant's",
    )


def _limit_flags(server: argparse._ArgumentGroup) -> None:
    """Admission limits, metrics window, shutdown, logging."""
    server.add_argument(
        "--max-queued-requests",
        type=int,
        default=ServerArgs.max_queued_requests,
        help="requests in flight (waiting + running) before new ones get 503 + Retry-After",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=ServerArgs.max_request_bytes,
        help="largest POST body accepted; a bigger one gets 413 before it is read or parsed",
    )
    server.add_argument(
        "--max-header-bytes",
        type=int,
        default=ServerArgs.max_header_bytes,
        help="largest request head (request line + headers); a bigger one gets 400 and the connection closes",
    )
    server.add_argument(
        "--header-timeout",
        type=float,
        default=ServerArgs.header_timeout,
        help="seconds a connection gets to send a complete request head (idle and slow-loris ones are closed)",
    )
    server.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=ServerArgs.keep_alive_timeout,
        help="seconds an idle keep-alive connection stays open after a response",
    )
    server.add_argument(
        "--max-connections",
        type=int,
        default=ServerArgs.max_connections,
        help="open connections at once; past it a new one is closed at once (0: the descriptor limit less 256)",
    )
    server.add_argument(
        "--hit-rate-window",
        type=int,
        default=ServerArgs.hit_rate_window,
        help="finished requests the cache_hit_rate gauge averages over",
    )
    server.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=ServerArgs.graceful_shutdown_timeout,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM; then they are aborted",
    )
    server.add_argument(
        "--log-level", default=ServerArgs.log_level, choices=LOG_LEVELS, help="debug also logs every HTTP request"
    )


def _scale_out_flags(scale: argparse._ArgumentGroup) -> None:
    """Engine replicas behind a cache-aware router (needs the [router] extra)."""
    scale.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="engine replicas behind a cache-aware router (0: one engine in this process, no Ray)",
    )
    scale.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto or ray://host:10001); default: start a local one",
    )
    scale.add_argument(
        "--router",
        default=ServerArgs.router,
        choices=ROUTER_POLICIES,
        help="how requests pick a replica (round-robin and power-of-two: for comparison)",
    )
    scale.add_argument(
        "--router-index",
        default=ServerArgs.router_index,
        choices=ROUTER_INDEXES,
        help="precise: the replicas' KV events; approximate: the prompts the router sent",
    )
    scale.add_argument(
        "--router-abs-threshold",
        type=int,
        default=ServerArgs.router_abs_threshold,
        help="load is out of balance when max - min requests exceeds this ...",
    )
    scale.add_argument(
        "--router-rel-threshold",
        type=float,
        default=ServerArgs.router_rel_threshold,
        help="... and max exceeds this times min: then the least-loaded replica wins",
    )
    scale.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="Ray CPUs per replica (default: min(1, cluster CPUs / replicas))",
    )


def parse_args(argv: list[str]) -> ServerArgs:
    """Flags -> ServerArgs; an invalid combination exits with argparse's usage error.

    Every config field is the flag of the same name, but for the few derived below.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    flags = vars(ns)
    # A check of the flags, not of ServerArgs: each replica's own ServerArgs sets its endpoint.
    if ns.replicas and (ns.kv_events_endpoint or ns.kv_events_replay_endpoint or ns.kv_events_config):
        parser.error(
            "--kv-events-endpoint is per server: with --replicas each replica publishes on a free "
            "port of its node (GET /router shows them)"
        )
    try:
        engine = EngineConfig.from_options(**{name: value for name, value in flags.items() if name in ENGINE_OPTIONS})
        return ServerArgs(
            **_same_named(ServerArgs, flags),
            **kv_events_fields(ns),
            engine=engine,
            api_keys=tuple(ns.api_key),
            shared_prefixes=tuple(ns.shared_prefix),
            shared_system_prompts=tuple(ns.shared_system_prompt),
        )
    except ValueError as exc:
        parser.error(str(exc))


def tracing_problems(endpoint: str) -> list[str]:
    """What keeps ``--otlp-traces-endpoint`` from working here: the SDK not installed, a URL that is not one."""
    try:
        from radixserve.server.tracing import traces_url
    except ImportError as exc:
        return [
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter ({exc.name} is not "
            "installed): pip install 'radixserve[tracing]'"
        ]
    try:
        traces_url(endpoint)
    except ValueError as exc:
        return [str(exc)]
    return []


def usage_error(message: str) -> NoReturn:
    """Exit as a bad flag does: ``radixserve serve``'s usage and ``message`` on stderr, exit code 2 (argparse's).
    For what only a try can tell (an endpoint that cannot be bound), found before the model loads."""
    build_parser().error(message)


def kv_events_fields(ns: argparse.Namespace) -> dict[str, Any]:
    """The ServerArgs kv_events_* fields from ``--kv-events-config`` or its shorthand flags (checked; a
    ValueError names the flag and the problem)."""
    flag = "--kv-events-config" if ns.kv_events_config is not None else "--kv-events-endpoint"
    try:
        config = _kv_events_config(ns)
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith("--") else f"{flag}: {exc}") from None
    return {
        "kv_events_endpoint": config.endpoint if ns.kv_events_config or ns.kv_events_endpoint else None,
        "kv_events_replay_endpoint": config.replay_endpoint,
        "kv_events_topic": config.topic,
        "kv_events_buffer_steps": config.buffer_steps,
        "kv_events_hwm": config.hwm,
    }


def _kv_events_config(ns: argparse.Namespace) -> KVEventsConfig:
    if ns.kv_events_config is not None:
        if ns.kv_events_endpoint or ns.kv_events_replay_endpoint:
            raise ValueError("--kv-events-config names the endpoints: drop --kv-events-endpoint / -replay-endpoint")
        config = parse_kv_events_config(ns.kv_events_config)
    elif ns.kv_events_endpoint is not None:
        config = KVEventsConfig(ns.kv_events_endpoint, ns.kv_events_replay_endpoint)
    elif ns.kv_events_replay_endpoint is not None:
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint (or --kv-events-config)")
    else:
        config = KVEventsConfig()
    return config


# ServerArgs fields that are not a flag's value as it stands (derived from other flags, or renamed); every
# other field is the flag of the same name. The engine's own options: EngineConfig.from_options.
_DERIVED = frozenset(
    {
        "engine",
        "api_keys",
        "shared_prefixes",
        "shared_system_prompts",
        "kv_events_endpoint",
        "kv_events_replay_endpoint",
    }
)


def _same_named(config: type[Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The flags whose name is a field of ``config``; a field with no flag keeps its default."""
    return {f.name: flags[f.name] for f in dataclasses.fields(config) if f.name in flags and f.name not in _DERIVED}
