"""An 8-bit pool says so: /server_info's engine, /metrics (cache_config_info's kv_cache_dtype label and the
tokens-per-GiB gauge), and the KV events (each BlockStored, and a v2 snapshot)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import Engine
from radixserve.engine import EngineConfig
from radixserve.kv_events.mirror import SNAPSHOT_V2, decode_snapshot
from radixserve.kv_events.wire import BlockStored, decode_batch
from radixserve.server.app import create_app
from radixserve.server.args import ServerArgs
from tests.server.test_kv_events import serve_and_publish


@pytest.mark.parametrize(
    "kv,backend,name", [("int8", "auto", "int8"), ("fp8_e4m3", "reference", "float8_e4m3fn")], ids=["int8", "fp8"]
)
def test_an_8bit_pool_is_reported_with_its_tokens_per_gib(
    tiny_model_dir: Path, tmp_path: Path, kv: str, backend: str, name: str
) -> None:
    config = EngineConfig(
        model_path=str(tiny_model_dir), max_total_tokens=512, kv_cache_dtype=kv, attention_backend=backend
    )
    endpoints = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv.replay"
    args = ServerArgs(
        engine=config, enable_metrics=True, kv_events_endpoint=endpoints[0], kv_events_replay_endpoint=endpoints[1]
    )
    engine = Engine(args.engine)
    info = engine.describe()
    assert info["resolved_kv_cache_dtype"] == name and info["kv_bytes_per_token"] == 2 * 2 * 2 * (
        16 + 2
    )  # layers, K and V, heads, codes + scale
    assert info["kv_tokens_per_gib"] == engine.kv_tokens_per_gib() == 2**30 // info["kv_bytes_per_token"]
    state = create_app(engine, args).state.radixserve
    text = generate_latest(state.metrics.registry).decode()
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["radixserve:cache_config_info"].labels["kv_cache_dtype"] == name
    assert samples["radixserve:kv_cache_tokens_per_gib"].value == info["kv_tokens_per_gib"]
    publisher = state.worker.events
    try:
        serve_and_publish(engine, publisher, [(list(range(10, 50)), None)])
        stored = [e for _, data in publisher._ring for e in decode_batch(data).events if isinstance(e, BlockStored)]
        assert stored and {e.kv_cache_dtype for e in stored} == {name}
        (_, _, payload), _ = publisher._answer([b"", SNAPSHOT_V2])
        snapshot = decode_snapshot(payload)
        assert (snapshot.kv_cache_dtype, snapshot.kv_tokens_per_gib) == (name, info["kv_tokens_per_gib"])
    finally:
        publisher.close()
