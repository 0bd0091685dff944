"""A router written against a peer engine's own KV event structs: its decoder, its replay protocol, no radixserve.

``peer_kv_events(name)`` is the peer's own module, unchanged: SGLang's always
(``make install`` adds it), vLLM's where it is installed (the test skips
otherwise): ``vllm`` installs ``--no-deps`` and ``vllm.distributed.kv_events``
imports on CPU with torch and ten small packages more (cbor2, openai-harmony,
cachetools, cloudpickle, pybase64, py-cpuinfo, xgrammar, apache-tvm-ffi,
partial-json-parser, llguidance), but it is a 336 MB wheel whose import of that
one module loads 276 of its modules and torch: too heavy for every ``make
install``.

``sglang_kv_events()`` imports SGLang's ``srt/disaggregation/kv_events.py`` from
the installed ``sglang`` package (installed ``--no-deps`` by the Makefile). That
module needs only msgspec, zmq, pydantic and psutil, but ``import sglang`` runs
the package's ``__init__`` (torch, triton, FlashInfer, ...): the two package
``__init__`` files on its import path are skipped by registering bare packages
over the real folders. The module itself is imported unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

END_SEQ = -1


def peer_kv_events(name: str) -> types.ModuleType:
    if name == "vllm":
        return pytest.importorskip("vllm.distributed.kv_events", reason="vllm is not installed (see tests/kv_events)")
    assert name == "sglang"
    return sglang_kv_events()


def sglang_kv_events() -> types.ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (make install adds it with --no-deps)")
    root = Path(spec.origin).parent
    name = "sglang.srt.disaggregation.kv_events"
    if name in sys.modules:
        return sys.modules[name]
    saved = {k: sys.modules.get(k) for k in ("sglang", "sglang.srt.utils")}
    try:
        for package, path in (("sglang", root), ("sglang.srt.utils", root / "srt" / "utils")):
            bare = types.ModuleType(package)
            bare.__path__ = [str(path)]
            sys.modules[package] = bare
        return importlib.import_module(name)
    finally:  # later imports of sglang see the real package
        for package, module in saved.items():
            if module is None:
                sys.modules.pop(package, None)
            else:
                sys.modules[package] = module


class PeerRouter:
    """Follows one publisher as a vLLM/SGLang router does: decode with ``module.KVEventBatch``, replay on gaps."""

    def __init__(self, module: types.ModuleType, endpoint: str, replay_endpoint: str, topic: str = "") -> None:
        self.module = module
        self.decoder: Any = msgspec.msgpack.Decoder(module.KVEventBatch)
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.blocks: set[int] = set()
        self.last_seq = -1
        self.replayed = 0  # batches applied from replays

    def poll(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            timeout_ms = 0
            _, seq_frame, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_frame, "big")
            if seq > self.last_seq + 1:
                self.replay(self.last_seq + 1)
            if seq == self.last_seq + 1:
                self.apply(seq, payload)

    def replay(self, start: int) -> None:
        """Their replay protocol: send the start seq (8 bytes big-endian), read batches to the sentinel."""
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                assert dealer.poll(30_000), "no answer from the replay socket"
                _, _, seq_frame, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if seq == END_SEQ:
                    assert payload == b""
                    return
                if seq == self.last_seq + 1:
                    self.apply(seq, payload)
                    self.replayed += 1
        finally:
            dealer.close()

    def apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        for event in batch.events:
            if isinstance(event, self.module.BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                self.blocks.update(event.block_hashes)
            elif isinstance(event, self.module.BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            else:
                assert isinstance(event, self.module.AllBlocksCleared)
                self.blocks.clear()
        self.last_seq = seq

    def close(self) -> None:
        self.sub.close()
