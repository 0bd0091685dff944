"""``Engine.flush_cache``: a flushed prefix is served by no tier (KV pool, host, disk), not even after a restart.

Float32 tiny model with a host tier and a cache directory, both write policies. The
prompt is put in all three tiers (a warm restart reads it from disk into the pool,
and an eviction copies it into L2), flushed, and asked again: nothing is cached.
The disk's page files are gone (the directory and its fingerprint stay) and a KV
events subscriber's mirror ends empty in every medium.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixserve.engine import Engine
from radixserve.engine.driver import RequestsInFlight
from radixserve.kv_events.mirror import BlockMirror
from radixserve.kv_events.wire import decode_batch, encode_batch, event_record

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
PROMPT = [int(t) for t in np.arange(3, 99)]  # six 16-token tier pages


def make(tiny_model_dir: Path, directory: Path, policy: str, **options: Any) -> Engine:
    return Engine.create(
        model_path=str(tiny_model_dir),
        dtype="float32",
        max_total_tokens=256,
        hicache_size=0.01,
        hicache_write_policy=policy,
        cache_dir=str(directory),
        **options,
    )


def page_files(directory: Path) -> list[Path]:
    return sorted((directory / "pages").rglob("*.kv"))


def mirror_events(engine: Engine, mirror: BlockMirror) -> None:
    """Apply what the engine announced since the last call to ``mirror``, as a subscriber would."""
    assert engine.cache.events is not None
    records = [r for r in (event_record(e, 16) for e in engine.cache.events.drain()) if r is not None]
    mirror.apply(mirror.seq + 1, decode_batch(encode_batch(records)))


def cached(engine: Engine) -> int:
    return engine.generate(input_ids=PROMPT, sampling_params=GREEDY).cached_tokens


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_flushed_prefix_is_served_by_no_tier_nor_after_a_restart(
    tiny_model_dir: Path, tmp_path: Path, policy: str
) -> None:
    directory = tmp_path / "kv"
    first = make(tiny_model_dir, directory, policy)
    assert cached(first) == 0
    assert first.close(30)
    assert page_files(directory)

    engine = make(tiny_model_dir, directory, policy, enable_kv_events=True)
    tiers, mirror = engine.cache.tiers, BlockMirror()
    assert tiers is not None and tiers.disk is not None and tiers.host is not None
    try:
        assert cached(engine) >= 80  # from disk
        engine.cache.evict(engine.cache.evictable_size())  # into L2 as well
        assert cached(engine) >= 80  # from L2
        mirror_events(engine, mirror)
        assert mirror.blocks and mirror.media["cpu"] and mirror.media["disk"]
        assert engine.flush_cache() > 0
        assert len(tiers.host) == 0 and len(tiers.disk) == 0
        mirror_events(engine, mirror)
        assert mirror.blocks == set() and all(not held for held in mirror.media.values())
        assert cached(engine) == 0  # no tier served it
        engine.flush_cache()
        assert tiers.disk.flush(30)  # the writer thread deleted the files
        assert page_files(directory) == [] and (directory / "pages").is_dir()
    finally:
        assert engine.close(30)
    assert list(directory.iterdir())  # the fingerprint and lock stay

    again = make(tiny_model_dir, directory, policy)
    try:
        assert again.cache.tiers is not None and again.cache.tiers.disk is not None
        assert len(again.cache.tiers.disk) == 0 and cached(again) == 0
    finally:
        again.close(30)


def test_flush_takes_the_tiers_to_drop(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = make(tiny_model_dir, tmp_path / "kv", "write_through")
    tiers = engine.cache.tiers
    assert tiers is not None and tiers.disk is not None and tiers.host is not None
    try:
        cached(engine)
        assert tiers.disk.flush(30)
        pages = len(tiers.disk)
        assert engine.flush_cache(tiers=("device", "host")) > 0
        assert len(tiers.host) == 0 and len(tiers.disk) == pages > 0
        assert cached(engine) >= 80  # the disk kept it (and wrote it through to L2 again)
        assert engine.flush_cache(tiers=["disk"]) == 0  # the pool keeps its tokens
        assert len(tiers.disk) == 0 and len(tiers.host) > 0 and engine.cache.total_size() > 0
        with pytest.raises(ValueError, match="tiers must be some of device, host, disk"):
            engine.flush_cache(tiers=("gpu",))
        with pytest.raises(ValueError, match="tiers must be some of"):
            engine.flush_cache(tiers=())
    finally:
        engine.close(30)


def test_flush_with_requests_in_flight_changes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = make(tiny_model_dir, tmp_path / "kv", "write_through")
    tiers = engine.cache.tiers
    assert tiers is not None and tiers.disk is not None
    try:
        cached(engine)
        assert tiers.disk.flush(30)
        pages, size = len(tiers.disk), engine.cache.total_size()
        req = engine.make_request(PROMPT, GREEDY)
        engine.submit(req)
        engine._drain(block=False)  # queued now, as a server's loop would have it
        with pytest.raises(RequestsInFlight):
            engine.flush_cache()
        assert len(tiers.disk) == pages and engine.cache.total_size() == size
        engine.abort(req.rid)
        engine._drain(block=False)
    finally:
        engine.close(30)
