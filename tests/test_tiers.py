"""The cache tiers through the offline engine: load-back equals recompute, restarts are warm, faults are safe.

Float32 tiny model: a page loaded back from L2 or L3 must give exactly the
tokens the no-tier engine computes. The pool holds one document; the working
set is six, so without tiers every second visit recomputes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from radixserve.engine import Engine

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
rng = random.Random(7)
DOCS = [[rng.randrange(3, 128) for _ in range(48)] for _ in range(6)]
PROMPTS = [doc + [10 + i, 11, 12, 13] for i in range(2) for doc in DOCS]  # every document twice


def make(tiny_model_dir: Path, **options: Any) -> Engine:
    return Engine.create(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=64, **options)


def run(engine: Engine, prompts: list[list[int]], extra_key: str | None = None) -> list[list[int]]:
    return [engine.generate(input_ids=p, sampling_params=GREEDY, extra_key=extra_key).output_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    return run(make(tiny_model_dir), PROMPTS)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_host_tier_loads_back_instead_of_recomputing(
    tiny_model_dir: Path, reference: list[list[int]], policy: str
) -> None:
    plain = make(tiny_model_dir)
    tiered = make(tiny_model_dir, hicache_size=0.01, hicache_write_policy=policy)
    assert run(plain, PROMPTS) == reference
    assert run(tiered, PROMPTS) == reference
    stats = tiered.cache.tiers.stats  # type: ignore[union-attr]
    assert stats.hit_tokens["host"] == 6 * 48  # every document's second visit, all three pages
    saved = plain.scheduler.stats.prefill_tokens - tiered.scheduler.stats.prefill_tokens
    assert saved == 6 * 48
    tiered.check_idle_invariants()


def test_a_small_host_tier_evicts_and_the_live_view_counts_it(tiny_model_dir: Path) -> None:
    """Room for ~2 of the 6 documents in L2: its LRU order evicts pages, and the dashboard's view says so."""
    roomy = make(tiny_model_dir, hicache_size=0.01)
    kv_bytes = roomy.describe()["kv_bytes_per_token"]
    small = make(tiny_model_dir, hicache_size=100 * kv_bytes / 2**30)
    for engine in (roomy, small):
        run(engine, PROMPTS)
    views = [engine.live_view() for engine in (roomy, small)]
    hosts = [[e for e in view["evictions"] if e["tier"] == "host"] for view in views]
    assert hosts[0] == [{"tier": "host", "policy": "lru", "unit": "pages", "evicted": 0}]
    assert hosts[1][0]["evicted"] == small.cache.tiers.stats.host_evicted_pages > 0  # type: ignore[union-attr]
    tier = views[1]["tiers"]["host"]
    assert 0 < tier["used_bytes"] <= tier["capacity_bytes"] and tier["stored_bytes"] > tier["used_bytes"]
    assert views[1]["totals"]["evicted_tokens"] == small.cache.evicted_tokens > 0


def test_disk_tier_survives_a_restart_and_keeps_tenants_apart(
    tiny_model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    first = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"))
    assert run(first, PROMPTS[:6]) == reference[:6]
    assert first.close(30)
    again = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"))
    result = again.generate(input_ids=PROMPTS[6], sampling_params=GREEDY)
    assert result.output_ids == reference[6] and result.cached_tokens == 48
    assert again.cache.tiers.stats.hit_tokens["disk"] == 48  # type: ignore[union-attr]
    other = again.generate(input_ids=PROMPTS[7], sampling_params=GREEDY, extra_key="tenant-b")
    assert other.output_ids == reference[7] and other.cached_tokens == 0
    again.check_idle_invariants()
    assert again.close(30)


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete", "directory"])
def test_corrupt_disk_pages_are_recomputed(
    tiny_model_dir: Path, reference: list[list[int]], tmp_path: Path, fault: str
) -> None:
    first = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"))
    run(first, PROMPTS[:6])
    assert first.close(30)
    pages = sorted((tmp_path / "kv" / "pages").glob("*/*.kv"))
    assert len(pages) >= 6 * 3
    again = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"))
    for page in pages:  # after the index was built: faults strike files the server believes good
        if fault == "flip":
            data = bytearray(page.read_bytes())
            data[-1] ^= 1
            page.write_bytes(bytes(data))
        elif fault == "truncate":
            page.write_bytes(page.read_bytes()[:100])
        else:
            page.unlink()
            if fault == "directory":  # issue 37: IsADirectoryError failed the request and stopped the scheduler
                page.mkdir()
    assert run(again, PROMPTS[6:]) == reference[6:]
    disk = again.cache.tiers.disk  # type: ignore[union-attr]
    assert disk is not None
    counted = {"delete": disk.stats.missing, "directory": disk.stats.unreadable}.get(fault, disk.stats.corrupt)
    assert counted >= 6 and again.cache.tiers.stats.hit_tokens["disk"] == 0  # type: ignore[union-attr]
    again.check_idle_invariants()
    again.close(30)


def test_another_models_directory_is_not_used(tiny_model_dir: Path, reference: list[list[int]], tmp_path: Path) -> None:
    first = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"), page_size=2)
    run(first, PROMPTS[:6])
    assert first.close(30)
    other = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"))  # another page size: another fingerprint
    assert other.cache.tiers is not None and other.cache.tiers.disk is None
    result = other.generate(input_ids=PROMPTS[6], sampling_params=GREEDY)
    assert result.output_ids == reference[6] and result.cached_tokens == 0
    other.close(30)


def test_disk_full_degrades_to_no_disk_tier(
    tiny_model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from radixserve.cache.tiers.disk_store import DiskPageStore

    def full(self: DiskPageStore, path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    engine = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"), hicache_size=0.01)
    monkeypatch.setattr(DiskPageStore, "_write_file", full)
    assert run(engine, PROMPTS) == reference
    engine.close(30)
    disk = engine.cache.tiers.disk  # type: ignore[union-attr]
    assert disk is not None and disk.stats.write_errors == 1 and not disk.writable
    assert engine.cache.tiers.stats.hit_tokens["host"] > 0  # type: ignore[union-attr]


def test_tier_options_are_checked(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="hicache_write_policy"):
        make(tiny_model_dir, hicache_size=1, hicache_write_policy="write_around")
    with pytest.raises(ValueError, match="need prefix_cache radix"):
        make(tiny_model_dir, prefix_cache="block", hicache_size=1)
    assert make(tiny_model_dir).cache.tiers is None  # no flags: no tiers, exactly as before


def test_server_flags_reach_the_engine_config() -> None:
    from radixserve.server.args import parse_args

    args = parse_args(
        ["--hicache-size", "2.5", "--hicache-write-policy", "write_through", "--hicache-compress"]
        + ["--cache-dir", "/tmp/kv", "--cache-dir-size", "10"]
    )
    engine = args.engine
    assert (engine.hicache_size, engine.hicache_write_policy, engine.hicache_compress) == (2.5, "write_through", True)
    assert (engine.cache_dir, engine.cache_dir_size) == ("/tmp/kv", 10.0)
    default = parse_args([]).engine
    assert (default.hicache_size, default.cache_dir) == (0.0, None)


def test_compressed_host_tier_serves_close_pages(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    """int8 L2 pages: lossy by design; the run completes, hits L2, and conserves slots."""
    tiered = make(tiny_model_dir, hicache_size=0.01, hicache_compress=True)
    outputs = run(tiered, PROMPTS)
    assert outputs[:6] == reference[:6]  # first visits compute everything: exact
    assert tiered.cache.tiers.stats.hit_tokens["host"] == 6 * 48  # type: ignore[union-attr]
    tiered.check_idle_invariants()


def restarted(tiny_model_dir: Path, tmp_path: Path) -> Engine:
    """An engine started on a cache dir holding the six documents' pages, with an empty L2 above it."""
    first = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"))
    run(first, PROMPTS[:6])
    assert first.close(30)
    return make(tiny_model_dir, cache_dir=str(tmp_path / "kv"), hicache_size=0.01)


def queue_and_prefetch(engine: Engine, prompt: list[int]) -> Any:
    req = engine.make_request(prompt, GREEDY)
    engine.scheduler.add(req)
    prefetcher = engine.cache.tiers.prefetcher  # type: ignore[union-attr]
    assert prefetcher is not None and prefetcher.wait_idle(120)
    return req


def finish(engine: Engine, req: Any) -> Any:
    while req.finish_reason is None:
        engine.step()
    return req.result()


def test_queued_request_prefetches_its_disk_pages_into_host(
    tiny_model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """After a restart the continuation is on disk only: queueing copies it to L2, admission loads from L2."""
    engine = restarted(tiny_model_dir, tmp_path)
    tiers = engine.cache.tiers
    assert tiers is not None and tiers.host is not None and len(tiers.host) == 0
    req = queue_and_prefetch(engine, PROMPTS[6])
    assert tiers.stats.pages_prefetched == 3 and len(tiers.host) == 3  # before any step ran
    result = finish(engine, req)
    assert result.output_ids == reference[6] and result.cached_tokens == 48
    assert tiers.stats.hit_tokens == {"host": 48, "disk": 0} and tiers.stats.prefetch_hits == 3
    assert run(engine, PROMPTS[7:]) == reference[7:]  # the rest, prefetched as they queue
    engine.check_idle_invariants()
    assert engine.close(30)


def test_prefetched_pages_evicted_or_corrupt_or_aborted_change_nothing(
    tiny_model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    engine = restarted(tiny_model_dir, tmp_path)
    tiers = engine.cache.tiers
    assert tiers is not None
    aborted = queue_and_prefetch(engine, PROMPTS[6])  # prefetched, then the client goes away
    assert engine.scheduler.abort(aborted) and tiers.stats.pages_prefetched == 3
    tiers.clear_host()  # L2 dropped under the waiting request: admission reads the disk itself
    req = queue_and_prefetch(engine, PROMPTS[6])
    tiers.clear_host()
    result = finish(engine, req)
    assert result.output_ids == reference[6] and result.cached_tokens == 48
    assert tiers.stats.hit_tokens["disk"] == 48 and tiers.stats.prefetch_hits == 0
    for page in sorted((tmp_path / "kv" / "pages").glob("*/*.kv")):  # every disk page now fails its check
        data = bytearray(page.read_bytes())
        data[-1] ^= 1
        page.write_bytes(bytes(data))
    req = queue_and_prefetch(engine, PROMPTS[7])
    result = finish(engine, req)
    assert result.output_ids == reference[7] and result.cached_tokens == 0  # recomputed, never loaded
    assert tiers.disk is not None and tiers.disk.stats.corrupt >= 1 and tiers.stats.pages_prefetched == 6
    engine.check_idle_invariants()
    engine.close(30)


# fp8 on CPU reads through the reference backend; its L2 asks for compression, which 8-bit pages skip.
EIGHT_BIT_POOLS = {"int8": {}, "fp8_e4m3": {"attention_backend": "reference", "hicache_compress": True}}


@pytest.mark.parametrize("kv", list(EIGHT_BIT_POOLS))
def test_8bit_pages_move_through_host_and_disk_as_they_are(tiny_model_dir: Path, tmp_path: Path, kv: str) -> None:
    """An 8-bit pool's pages (codes and scales) in L2 and L3: half a bfloat16 page's bytes, loaded back bit for bit,
    so the tiered engine gives the tokens of the same pool without tiers."""
    options = {"kv_cache_dtype": kv, **EIGHT_BIT_POOLS[kv]}
    expected = run(make(tiny_model_dir, **options), PROMPTS)
    tiered = make(tiny_model_dir, **options, hicache_size=0.01, cache_dir=str(tmp_path / "kv"))
    assert run(tiered, PROMPTS) == expected
    tiers = tiered.cache.tiers
    assert tiers is not None and tiers.stats.hit_tokens["host"] > 0
    layout = tiers.mover.layout  # type: ignore[attr-defined]
    bf16_page = layout.num_layers * 2 * layout.num_kv_heads * layout.page_tokens * layout.head_dim * 2
    assert layout.page_bytes == bf16_page * (layout.head_dim + 2) // (2 * layout.head_dim)
    assert tiers.host is not None and tiers.host.used_bytes % layout.page_bytes == 0
    tiered.check_idle_invariants()
    assert tiered.close(30)
    again = make(tiny_model_dir, **options, cache_dir=str(tmp_path / "kv"))
    result = again.generate(input_ids=PROMPTS[6], sampling_params=GREEDY)
    assert result.output_ids == expected[6] and result.cached_tokens == 48
    again.close(30)


@pytest.mark.parametrize(
    "before,after,message",
    [
        ({}, {"kv_cache_dtype": "int8"}, "float32 in the files, int8 now"),
        (
            {"kv_cache_dtype": "int8"},
            {"kv_cache_dtype": "fp8_e4m3", **EIGHT_BIT_POOLS["fp8_e4m3"]},
            "int8 in the files, float8_e4m3fn now",
        ),
    ],
    ids=["float32-int8", "int8-fp8"],
)
def test_a_restart_with_another_kv_dtype_does_not_use_the_directory(
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    before: dict[str, Any],
    after: dict[str, Any],
    message: str,
) -> None:
    first = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"), **before)
    run(first, PROMPTS[:6])
    assert first.close(30)
    with caplog.at_level("WARNING"):
        other = make(tiny_model_dir, cache_dir=str(tmp_path / "kv"), **after)
    assert other.cache.tiers is not None and other.cache.tiers.disk is None
    assert any(f"kv_layout dtype: {message}" in record.getMessage() for record in caplog.records)
    result = other.generate(input_ids=PROMPTS[6], sampling_params=GREEDY)
    assert result.cached_tokens == 0
    other.close(30)
