"""The server's parts without a server: flags, the hit-rate window (streamed text: tests/test_output.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from radixserve.engine import EngineConfig
from radixserve.engine.config import ENGINE_OPTIONS
from radixserve.server.args import ServerArgs, build_parser, parse_args
from radixserve.server.metrics import ServerMetrics

FLAGS = [
    "--model-path",
    "--host",
    "--port",
    "--prefix-cache",
    "--disable-radix-cache",
    "--page-size",
    "--radix-eviction-policy",
    "--schedule-policy",
    "--max-total-tokens",
    "--chunked-prefill-size",
    "--enable-mixed-chunk",
    "--max-running-requests",
    "--dtype",
    "--kv-cache-dtype",
    "--device",
    "--enable-metrics",
    "--api-key",
    "--log-level",
    "--replicas",
    "--ray-address",
    "--router",
    "--router-index",
]


def test_help_documents_every_flag_the_issue_names() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "radixserve", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in FLAGS:
        assert flag in out, flag
    actions = {opt: a for a in build_parser()._actions for opt in a.option_strings}
    assert all(actions[flag].help for flag in FLAGS)


def test_flags_resolve_into_engine_and_server_args() -> None:
    args = parse_args(
        [
            "--disable-radix-cache",
            "--page-size",
            "16",
            "--schedule-policy",
            "lpm",
            "--radix-eviction-policy",
            "slru",
            "--api-key",
            "k",
            "--port",
            "8000",
            "--enable-mixed-chunk",
        ]
    )
    assert args.engine.prefix_cache == "none" and args.engine.page_size == 16
    assert args.engine.enable_mixed_chunk and not parse_args([]).engine.enable_mixed_chunk
    assert args.engine.schedule_policy == "lpm" and args.engine.radix_eviction_policy == "slru"
    resolved = args.resolved()
    assert resolved["api_keys"] == "<1 set>" and resolved["port"] == 8000 and resolved["prefix_cache"] == "none"
    assert resolved["served_model_name"] == "SmolLM2-135M-Instruct"
    assert args.replicas == 0  # one engine in this process unless asked
    scaled = parse_args(
        [
            "--replicas",
            "4",
            "--router",
            "round-robin",
            "--router-index",
            "approximate",
            "--router-abs-threshold",
            "3",
            "--ray-address",
            "auto",
        ]
    )
    assert (scaled.replicas, scaled.router, scaled.router_index) == (4, "round-robin", "approximate")
    assert scaled.router_abs_threshold == 3 and scaled.ray_address == "auto" and scaled.replica_cpus is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--page-size", "0"],
        ["--port", "70000"],
        ["--schedule-policy", "nope"],
        ["--max-total-tokens", "3"],
        ["--hit-rate-window", "0"],
        ["--replicas", "-1"],
        ["--router", "random"],
        ["--kv-cache-dtype", "fp8"],
        ["--router-rel-threshold", "0.5"],
        ["--replicas", "2", "--kv-events-endpoint", "tcp://127.0.0.1:5557"],
    ],
)
def test_bad_flags_exit_with_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and "error" in capsys.readouterr().err


def test_server_args_check_themselves_without_flags() -> None:
    """The Ray path builds ServerArgs directly: the same checks as the flags."""
    with pytest.raises(ValueError, match="tenant-isolation needs identities"):
        ServerArgs(tenant_isolation=True)
    with pytest.raises(ValueError, match="--replicas and --router-abs-threshold must be >= 0"):
        ServerArgs(replicas=-1)
    with pytest.raises(ValueError, match="--router must be one of"):
        ServerArgs(router="random")
    assert ServerArgs(tenant_isolation=True, tenant_header="x-tenant").tenant_isolation


def test_every_engine_option_with_a_flag_of_its_name_reaches_the_config() -> None:
    args = parse_args(["--schedule-policy", "random", "--schedule-seed", "7", "--num-threads", "3"])
    assert (args.engine.schedule_policy, args.engine.schedule_seed, args.engine.num_threads) == ("random", 7, 3)
    flags = {a.dest for a in build_parser()._actions}
    derived = {"prefix_cache", "in_batch_dedup", "enable_kv_events"}  # from --disable-* and --kv-events-endpoint
    assert {f.name for f in dataclasses.fields(EngineConfig)} - flags <= derived


def test_hit_rate_gauge_averages_the_window_and_keeps_its_value() -> None:
    metrics = ServerMetrics(hit_rate_window=3)
    for prompt, cached in [(100, 0), (100, 50), (100, 100), (200, 200)]:
        metrics.on_finish(prompt, cached, 5, "stop", 0.1)
    assert metrics.cache_hit_rate._value.get() == pytest.approx(350 / 400)  # the first fell out of the window
    metrics.on_step(0, 0, 0.0, 10, 1)
    metrics.on_step(0, 0, 0.0, 25, 1)
    assert metrics.cache_hit_rate._value.get() == pytest.approx(350 / 400)  # steps do not overwrite it
    text = metrics.render().decode()
    assert "radixserve:evicted_tokens_total 25.0" in text and "radixserve:retractions_total 1.0" in text
    assert 'radixserve:requests_total{finish_reason="stop"} 4.0' in text


def test_keywords_and_flags_take_one_path_to_the_engine_config() -> None:
    """``Engine(**options)`` and ``radixserve serve``'s flags build the same config (SGLang's switches included)."""
    argv = ["--model-path", "m.gguf", "--disable-radix-cache", "--disable-in-batch-dedup", "--page-size", "4"]
    options = {"model_path": "m.gguf", "disable_radix_cache": True, "disable_in_batch_dedup": True, "page_size": 4}
    assert parse_args(argv).engine == EngineConfig.from_options(**options)
    assert EngineConfig.from_options(**options) == EngineConfig(
        model_path="m.gguf", prefix_cache="none", in_batch_dedup=False, page_size=4
    )
    flags = {a.dest for a in build_parser()._actions}
    assert ENGINE_OPTIONS - flags == {"in_batch_dedup", "enable_kv_events"}  # a switch, and the endpoint's shadow
    with pytest.raises(TypeError):
        EngineConfig.from_options(disable_radix_cachee=True)


def test_kv_events_are_one_fact_the_endpoint() -> None:
    """A ServerArgs built without flags (Ray, tests) with an endpoint publishes: the engine's log follows it."""
    assert ServerArgs(kv_events_endpoint="ipc:///tmp/kv").engine.enable_kv_events
    assert not ServerArgs(engine=EngineConfig(enable_kv_events=True)).engine.enable_kv_events  # nobody would drain it
    assert parse_args(["--kv-events-endpoint", "tcp://127.0.0.1:5557"]).engine.enable_kv_events
