"""The tiered cache (L1 pool, L2 host, L3 disk) against a brute-force reference, checked after every step.

The "model" writes into every slot a value derived from (namespace, the token
prefix it ends), so a page loaded back from any tier is checked for exactly the
K/V a recompute would write: a page of another prefix or another tenant shows.
With unbounded lower tiers the reference predicts every match exactly: each
whole tier page the tree ever held is in L1 or below, so a request gets the
longest run of such pages. With a tiny L2 spilling to a bounded disk it checks
that nothing is invented, every page is in one state per tier, host bytes and
KV slots are conserved, and locked prefixes survive the evictions a load causes.
KV events follow: after each drain, the pages announced in a tier (stores
minus drops, with their medium) are exactly the pages that tier holds, each
announced with its own parent, tokens and namespace, a restart's disk pages
included (from their files' labels, parents first, never again when read).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from radixserve.cache import CacheReq, KVEventLog, RadixCache, RadixKey
from radixserve.cache.core.key import page_hashes
from radixserve.cache.core.radix_check import check_slot_conservation
from radixserve.cache.tiers.disk_store import DiskPageStore
from radixserve.cache.tiers.host_arena import HostArena
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.kv_pages import PoolPageMover
from radixserve.kv_events.wire import BlockRemoved, BlockStored, event_record, tier_of, wire_hash
from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool
from tests.cache.core.test_radix_machine import key_strategy
from tests.cache.helpers import counter_clock
from tests.machine_settings import machine_settings

PageKey = tuple[str | None, tuple[int, ...]]
PageContent = tuple[int | None, tuple[int, ...], str | None]  # a page's wire parent hash, tokens, namespace


def kv_value(ns: str | None, prefix: np.ndarray) -> float:
    """What the fake model writes for the last token of ``prefix`` (exact in float32)."""
    digest = hashlib.blake2b(repr((ns, prefix.tolist())).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest, "little") % (1 << 20))


class TierMachine(RuleBasedStateMachine):
    page_size = 1
    write_policy = "write_back"
    unbounded = True
    # Across every run of one test: the tiers were really exercised (restored: a start's disk page announced).
    loaded = {"host": 0, "disk": 0, "prefetched": 0, "restored": 0}

    def __init__(self) -> None:
        super().__init__()
        self.tier_page = 2 * self.page_size
        self.dir = Path(tempfile.mkdtemp())
        self.ever: set[PageKey] = set()  # whole tier pages the tree has held
        self.content: dict[int, PageContent] = {}  # the same pages by wire hash: what their BlockStored must say
        self.live: list[CacheReq] = []
        self.seen: list[tuple[str | None, np.ndarray]] = []  # prompts opened so far: queue_request repeats them
        self.open_cache()

    def open_cache(self) -> None:
        """A process starting: L1 and L2 empty, L3 (bounded runs) whatever ``self.dir`` holds, events from seq 0."""
        self.allocator = TokenAllocator(12 * self.page_size, self.page_size)
        self.pool = KVPool(1, self.allocator.size + self.page_size, 1, 2)
        mover = PoolPageMover(self.pool, self.tier_page)
        page_bytes = mover.layout.page_bytes
        if self.unbounded:
            host, disk = HostArena(1 << 30), None
        else:  # L2 = 16 tokens (L1 holds 12), L3 = 32: both tiers spill all the time
            host = HostArena(8 * page_bytes)
            disk = DiskPageStore(self.dir, 16 * (page_bytes + 64), {"test": 1})
        events = KVEventLog(self.page_size)
        tiers = TierIndex(mover, self.tier_page, host, disk, self.write_policy, events=events)  # type: ignore[arg-type]
        self.cache = RadixCache(self.allocator, self.page_size, "lru", counter_clock(), [events], tiers)
        self.announced: dict[str | None, set[int]] = {"cpu": set(), "disk": set()}  # per tier, from KV events
        self.age = 0  # steps since the start

    # ---- the fake model and the reference -------------------------------------------------------

    def compute(self, req: CacheReq, start: int) -> None:
        for pos in range(start, len(req.token_ids)):
            value = kv_value(req.extra_key, req.token_ids[: pos + 1])
            slot = int(req.kv_indices[pos])
            self.pool.k[0][0, slot] = torch.tensor([value, pos])
            self.pool.v[0][0, slot] = torch.tensor([-value, pos])

    def check_kv(self, ns: str | None, token_ids: np.ndarray, slots: np.ndarray) -> None:
        for pos, slot in enumerate(slots.tolist()):
            want = [kv_value(ns, token_ids[: pos + 1]), pos]
            assert self.pool.k[0][0, slot].tolist() == want, f"wrong K at position {pos}"
            assert self.pool.v[0][0, slot].tolist() == [-want[0], pos], f"wrong V at position {pos}"

    def tier_pages(self, ns: str | None, token_ids: np.ndarray) -> list[PageKey]:
        b = self.tier_page
        return [(ns, tuple(token_ids[:end].tolist())) for end in range(b, len(token_ids) + 1, b)]

    def record_tree(self) -> None:
        b = self.tier_page
        for node in self.cache.nodes():
            if not node.children:
                ns, path = node.key.extra_key, self.cache.path_key(node).token_ids
                self.ever.update(self.tier_pages(ns, path))
                hashes = [wire_hash(h) for h in page_hashes(path, ns, b)]
                for i, page in enumerate(hashes):
                    self.content[page] = (hashes[i - 1] if i else None, tuple(path[i * b : (i + 1) * b].tolist()), ns)

    def expected_len(self, ns: str | None, token_ids: np.ndarray, l1_len: int) -> int:
        pages, b = self.tier_pages(ns, token_ids), self.tier_page
        index = l1_len // b
        while index < len(pages) and pages[index] in self.ever:
            index += 1
        return max(l1_len, index * b)

    # ---- rules ------------------------------------------------------------------------------------

    def open(self, ns: str | None, arr: np.ndarray) -> CacheReq | None:
        self.seen.append((ns, arr))
        l1_len = len(self.cache.match_prefix(RadixKey(arr, ns)).indices)
        free_before = self.allocator.free_size() + self.cache.evictable_size()
        req = self.cache.open_request(RadixKey(arr, ns))
        got = len(req.token_ids)
        if self.unbounded and free_before >= len(arr):
            assert got == self.expected_len(ns, arr, l1_len), "continuation differs from the reference"
        assert l1_len <= got and all(
            page in self.ever for page in self.tier_pages(ns, arr[:got])[l1_len // self.tier_page :]
        )
        self.check_kv(ns, req.token_ids, req.kv_indices)  # loaded pages hold exactly the recomputed K/V
        if not self.cache.extend_request(req, arr[got:]):
            self.cache.cache_finished_req(req, is_insert=False)
            return None
        self.compute(req, got)
        return req

    @precondition(lambda self: len(self.live) < 3)
    @rule(data=st.data())
    def open_request(self, data: st.DataObject) -> None:
        ns, token_ids = data.draw(key_strategy(self.page_size))
        req = self.open(ns, np.asarray(token_ids, dtype=np.int64))
        if req is not None:
            self.live.append(req)

    @rule(data=st.data())
    def serve_request(self, data: st.DataObject) -> None:
        ns, token_ids = data.draw(key_strategy(self.page_size))
        req = self.open(ns, np.asarray(token_ids, dtype=np.int64))
        if req is not None:
            self.cache.cache_finished_req(req)
            self.record_tree()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), is_insert=st.booleans())
    def finish_request(self, data: st.DataObject, is_insert: bool) -> None:
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.cache.cache_finished_req(req, is_insert=is_insert)
        self.record_tree()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def chunk_request(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        self.cache.cache_unfinished_req(req)
        self.record_tree()

    @rule(data=st.data())
    def queue_request(self, data: st.DataObject) -> None:
        """A request is queued: its disk pages are prefetched into L2 on the thread, racing the next rules."""
        if self.seen and data.draw(st.booleans()):  # a prompt seen before: its pages may be on disk only
            ns, arr = data.draw(st.sampled_from(self.seen))
        else:
            ns, token_ids = data.draw(key_strategy(self.page_size))
            arr = np.asarray(token_ids, dtype=np.int64)
        key = RadixKey(arr, ns)
        l1_len = self.cache.cached_len(key)  # the read-only walk agrees with match_prefix
        assert l1_len == len(self.cache.match_prefix(key).indices)
        self.cache.prefetch(object(), key)
        self.cache.cancel_prefetch(object())  # another request's token: changes nothing
        prefetcher = self.cache.tiers.prefetcher if self.cache.tiers is not None else None
        if prefetcher is not None and data.draw(st.booleans()):  # else it races the next rules
            assert prefetcher.wait_idle(120)

    @rule(num_pages=st.integers(1, 6))
    def evict(self, num_pages: int) -> None:
        self.cache.evict(num_pages * self.page_size)

    # Every 8 steps at most, once the disk holds something: a restart empties L1 and L2, so more would starve them.
    @precondition(
        lambda self: self.cache.tiers and self.cache.tiers.disk and len(self.cache.tiers.disk) and self.age >= 8
    )
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """The process stops (queued disk writes land) and another starts on the same directory: its first drain
        announces the pages on disk, in full, parents first; reading one later announces nothing. Then a prompt
        seen before comes back (what a restart is for)."""
        for req in self.live:
            self.cache.cache_finished_req(req)
        self.live = []
        self.record_tree()
        self.check_events()
        self.close_tiers(30)
        # The scan's order made the files' names' (their hashes'): unrelated to the chains, so children often
        # come first, as after a copy of the directory or a clock step (drawing an order would change the examples).
        for age, path in enumerate(sorted((self.dir / "pages").glob("*/*.kv"))):
            os.utime(path, (1e9 + age, 1e9 + age))
        self.open_cache()
        self.check_events(at_start=True)  # the start's announcements: each page on disk, in full, parents first
        if self.seen:
            ns, arr = data.draw(st.sampled_from(self.seen))
            req = self.open(ns, arr)
            if req is not None:
                self.cache.cache_finished_req(req)
                self.record_tree()

    # ---- checked after every step ------------------------------------------------------------------

    @invariant()
    def everything_holds(self) -> None:
        self.age += 1
        tiers = self.cache.tiers
        assert tiers is not None
        if tiers.disk is not None:
            assert tiers.disk.flush(30)
        self.cache.check_invariants()
        check_slot_conservation(self.cache, self.live)
        for req in self.live:  # locks honoured: a live request's K/V is never taken
            self.check_kv(req.extra_key, req.token_ids, req.kv_indices)
        for node in self.cache.nodes():
            if not node.children:
                key, slots = self.cache._path_key_slots(node)
                self.check_kv(key.extra_key, key.token_ids, slots)
        assert tiers.host is not None
        with tiers.lock:  # a prefetch may be running
            tiers.host.check()
            for page_hash in tiers.host.hashes():
                assert tiers.page_states(page_hash)[0]
        if tiers.disk is not None:
            assert tiers.disk.used_bytes <= tiers.disk.capacity_bytes
            for page_hash in list(tiers.disk._index):
                assert tiers.page_states(page_hash)[1] == "on_disk"
        self.check_events()

    def check_events(self, at_start: bool = False) -> None:
        """A subscriber keeping one set per tier from the KV events, drained now, holds exactly each tier's pages.

        Exactly: every tier page is one block here, never announced stored twice or removed when it was not
        announced (what a reference-counting consumer needs), and each store names the page's own parent, tokens
        and namespace. ``at_start``: the drain after a restart, whose disk pages come each after its parent.
        """
        tiers, events = self.cache.tiers, self.cache.events
        assert tiers is not None and tiers.host is not None and events is not None
        with tiers.lock:  # no prefetch changes L2 or queues disk writes meanwhile
            if tiers.disk is not None:
                assert tiers.disk.flush(30)  # the writer is idle: no disk drop races the drain
            records = [event_record(event, self.tier_page) for event in events.drain()]
            tier_records = [r for r in records if isinstance(r, BlockStored | BlockRemoved) and r.medium is not None]
            batch = {r.block_hashes[0] for r in tier_records if isinstance(r, BlockStored)}
            for record in tier_records:
                (block,) = record.block_hashes
                tier = tier_of(record.medium)
                mirror, removed = self.announced[tier], isinstance(record, BlockRemoved)
                assert (block in mirror) == removed, record
                (mirror.discard if removed else mirror.add)(block)
                if isinstance(record, BlockStored):
                    parent = record.parent_block_hash
                    assert self.content[block] == (parent, tuple(record.token_ids), record.namespace), record
                    if at_start:
                        assert parent is None or parent not in batch or parent in mirror, "a child before its parent"
                        self.loaded["restored"] += 1
            assert self.announced["cpu"] == {wire_hash(h) for h in tiers.host.hashes()}
            on_disk = {wire_hash(h) for h in tiers.disk._index} if tiers.disk is not None else set()
            assert self.announced["disk"] == on_disk

    def teardown(self) -> None:
        for req in self.live:
            self.cache.cache_finished_req(req)
        self.cache.check_invariants()
        check_slot_conservation(self.cache, [])
        self.close_tiers(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def close_tiers(self, timeout: float) -> None:
        """Count what the tiers loaded (for the test's check that they were exercised), then close them."""
        if self.cache.tiers is not None:
            for tier, count in self.cache.tiers.stats.hit_tokens.items():
                self.loaded[tier] += count
            self.loaded["prefetched"] += self.cache.tiers.stats.pages_prefetched  # read from disk, then loaded
            self.cache.tiers.close(timeout)


@pytest.mark.parametrize("unbounded", [True, False])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_tiered_cache_matches_reference(page_size: int, write_policy: str, unbounded: bool) -> None:
    attrs = {"page_size": page_size, "write_policy": write_policy, "unbounded": unbounded}
    loaded = {"host": 0, "disk": 0, "prefetched": 0, "restored": 0}
    machine = type("Machine", (TierMachine,), {**attrs, "loaded": loaded})

    def reached_every_tier() -> bool:
        disk_read = loaded["disk"] + loaded["prefetched"]  # a prefetch turns a disk hit into a host hit
        return loaded["host"] > 0 and (unbounded or (disk_read > 0 and loaded["restored"] > 0))

    # The checks below ask that the examples, together, reached every tier (a restart's disk page read included).
    # Which steps run depends on the prefetcher's thread racing the rules, so even a derandomized batch of 20
    # examples sometimes never restarts (page 4, write-back, bounded: one run in four with a fresh seed, and CI
    # hit it derandomized under load). More batches (random seeds, every invariant checked as in the first) until
    # the tiers were reached: ten batches all missing is ~1e-6.
    for batch in range(10):
        run_state_machine_as_test(
            machine, settings=settings(machine_settings(20, 30), derandomize=batch == 0, database=None)
        )
        if reached_every_tier():
            break
    assert reached_every_tier(), loaded
