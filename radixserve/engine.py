"""The offline engine: ``Engine(...).generate(...)`` and ``.chat(...)``, no HTTP.

Wires the layers: loader -> model + KV pool -> prefix cache over the slot
allocator -> scheduler step loop. Every request's cached prefix is matched,
locked and reused; finished requests insert prompt + output into the cache.

    from radixserve import Engine
    engine = Engine()                     # the embedded SmolLM2-135M-Instruct
    out = engine.chat([{"role": "user", "content": "Hi!"}], {"max_new_tokens": 32})
    print(out["text"], out["meta_info"]["cached_tokens"])
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.cache import PREFIX_CACHES, create_prefix_cache
from radixserve.cache.policy import EVICTION_POLICIES
from radixserve.core import SamplingParams
from radixserve.memory import TokenAllocator
from radixserve.memory.kv_pool import KVPool
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.paged_kernel import ATTENTION_BACKENDS
from radixserve.model.precision import DTYPES as DTYPES  # re-exported: server/args.py builds --dtype from it
from radixserve.model.precision import resolve_dtype
from radixserve.model.quant import QUANTIZATIONS, weight_bytes
from radixserve.model.runner import ModelRunner
from radixserve.scheduler.loop import Scheduler
from radixserve.scheduler.policy import SCHEDULE_POLICIES, create_schedule_policy
from radixserve.scheduler.request import Request

logger = logging.getLogger(__name__)

Params = SamplingParams | dict[str, Any] | None


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine; validated here, unknown options are an error."""

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    prefix_cache: str = "radix"  # radix | block | none
    page_size: int = 1
    radix_eviction_policy: str = "lru"
    schedule_policy: str = "fcfs"  # fcfs | lpm | dfs-weight | lof | random | routing-key | priority | hrrn
    in_batch_dedup: bool = True  # hold requests whose shared uncached prefix a sibling is computing
    max_total_tokens: int | None = None  # KV pool size in tokens; None: a share of free memory
    max_running_requests: int = 64
    chunked_prefill_size: int = 8192  # prefill tokens per step; longer prompts go in chunks
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with AMX / AVX512-BF16, else float32
    quantization: str = "none"  # none | int8 (weight-only, per-channel scales)
    attention_backend: str = "auto"  # auto | paged (in place, CPU kernel) | reference (gather + SDPA)
    device: str = "auto"  # auto: cuda when present, else cpu
    num_threads: int = 1  # torch CPU threads: 1 is the safe default on a small shared box
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.prefix_cache in PREFIX_CACHES, f"prefix_cache must be one of {PREFIX_CACHES}"),
            (
                self.radix_eviction_policy in EVICTION_POLICIES,
                f"radix_eviction_policy: one of {sorted(EVICTION_POLICIES)}",
            ),
            (self.schedule_policy in SCHEDULE_POLICIES, f"schedule_policy must be one of {SCHEDULE_POLICIES}"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.max_total_tokens is None or self.max_total_tokens >= 16, "max_total_tokens must be >= 16"),
            (self.max_running_requests >= 1 and self.chunked_prefill_size >= 1, "limits must be >= 1"),
            (self.dtype == "auto" or self.dtype in DTYPES, f"dtype must be auto or one of {sorted(DTYPES)}"),
            (self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device: auto|cpu|cuda[:N]"),
            (self.num_threads >= 1, "num_threads must be >= 1"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("; ".join(problems))

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        """(dtype, why): auto asks the CPU whether it multiplies bfloat16 natively."""
        return resolve_dtype(self.dtype, device)


class Engine:
    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    def __init__(self, **options: Any) -> None:
        self.config = config = EngineConfig(**options)
        torch.set_num_threads(config.num_threads)
        self.device = config.resolved_device()
        dtype, self.dtype_reason = config.resolved_dtype(self.device)
        logger.info("dtype %s: %s", str(dtype).removeprefix("torch."), self.dtype_reason)
        self.loaded: LoadedModel = load_model(
            config.model_path, self.device, dtype, config.attention_backend, config.quantization
        )
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.config
        page = config.page_size if config.prefix_cache == "radix" else 1
        size = config.max_total_tokens or default_pool_tokens(
            model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 2 * dtype.itemsize,
            self.device,
        )
        size -= size % max(page, 16)
        self.allocator = TokenAllocator(size, page)
        self.kv_pool = KVPool(
            model_config.num_layers, size + page, model_config.num_kv_heads, model_config.head_dim, dtype, self.device
        )
        self.cache = create_prefix_cache(
            config.prefix_cache,
            self.allocator,
            config.page_size,
            config.radix_eviction_policy,
            enable_kv_events=config.enable_kv_events,
        )
        runner = ModelRunner(self.loaded.model, model_config, self.kv_pool, self.device)
        eos = tuple(model_config.eos_token_ids) + tuple(self.tokenizer.eos_token_ids)
        policy = create_schedule_policy(config.schedule_policy, in_batch_dedup=config.in_batch_dedup)
        self.scheduler = Scheduler(
            runner,
            self.cache,
            self.tokenizer.decode_continuation,
            eos,
            config.max_running_requests,
            config.chunked_prefill_size,
            policy,
        )
        self._rids = itertools.count()
        logger.info("engine ready: %s, %d KV slots, %s on %s", config, size, dtype, self.device)

    # ---- public API -------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: Params | list[Params] = None,
        input_ids: list[int] | list[list[int]] | None = None,
        extra_key: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list (returns a list, same order).

        Each result: ``{"text", "output_ids", "meta_info": {"prompt_tokens", "cached_tokens",
        "completion_tokens", "finish_reason", "e2e_latency", ...}}``.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and (not input_ids or isinstance(input_ids[0], int)))
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            prompts = [self.tokenizer.encode(text) for text in texts]
        else:
            prompts = [input_ids] if single else list(input_ids)  # type: ignore[list-item,arg-type]
        results = self._run(prompts, sampling_params, extra_key)  # type: ignore[arg-type]
        return results[0] if single else results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: Params | list[Params] = None,
        extra_key: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Apply the model's chat template, then ``generate``. A list of conversations gives a list."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        ids = [self.tokenizer.apply_chat_template(conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(input_ids=ids[0] if single else ids, sampling_params=sampling_params, extra_key=extra_key)

    def flush_cache(self) -> None:
        """Drop every cached prefix (only when no request is in flight)."""
        if self.scheduler.has_work():
            raise RuntimeError("flush_cache while requests are in flight")
        self.cache.reset()

    def check_idle_invariants(self) -> None:
        """With nothing in flight: the cache is consistent and free + cached == pool."""
        assert not self.scheduler.has_work(), "requests still in flight"
        self.cache.check_invariants()
        assert self.cache.protected_size() == 0, "a prefix is still locked"
        assert self.allocator.free_size() + self.cache.total_size() == self.allocator.size, "KV slots leaked"

    # ---- internals --------------------------------------------------------------------------------

    def _run(
        self, prompts: list[Sequence[int]], params: Params | list[Params], extra_key: str | None
    ) -> list[dict[str, Any]]:
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(per_request)} sampling_params for {len(prompts)} prompts")
        requests = [self.make_request(p, sp, extra_key) for p, sp in zip(prompts, per_request)]  # validate all first
        for req in requests:
            self.scheduler.add(req)
        while any(req.finish_reason is None for req in requests):
            self.scheduler.step()
        return [req.result().to_dict() for req in requests]

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + output) one request may hold: the model's context."""
        return self.loaded.config.max_position_embeddings

    def make_request(
        self,
        prompt: Sequence[int],
        params: Params,
        extra_key: str | None = None,
        arrival_time: float | None = None,
        shared_len: int = 0,
    ) -> Request:
        """A validated request (not yet queued); ValueError says what is wrong with the input.

        ``max_new_tokens`` is clipped to what the context leaves after the prompt.
        ``shared_len``: leading prompt tokens cached in the shared namespace even
        though the request has its own ``extra_key`` (rounded down to a page).
        Thread-safe: the server calls it off the scheduler thread.
        """
        sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ValueError("a prompt must be a sequence of integer token ids") from None
        vocab, max_pos = self.loaded.config.vocab_size, self.context_length
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("a prompt must be a non-empty sequence of token ids")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
        if len(ids) >= max_pos:
            raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {max_pos} tokens")
        if len(ids) + 1 > self.allocator.size:
            raise ValueError(f"the prompt has {len(ids)} tokens but the KV pool holds {self.allocator.size}")
        sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, max_pos - len(ids)))
        req = Request(next(self._rids), ids, sp, extra_key)
        if extra_key is not None and shared_len > 0:
            req.shared_len = min(shared_len, len(ids)) - min(shared_len, len(ids)) % self.config.page_size
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return req

    def describe(self) -> dict[str, Any]:
        """The resolved configuration: what was asked for, and what it became on this machine."""
        model = self.loaded.config
        kv_bytes = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, self.kv_pool.dtype)
        return {
            **dataclasses.asdict(self.config),
            "resolved_model_path": str(self.loaded.path),
            "resolved_device": str(self.device),
            "resolved_dtype": str(self.kv_pool.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "resolved_attention_backend": self.loaded.model.attention_backend,
            "weight_bytes": weight_bytes(self.loaded.model),
            "kv_pool_tokens": self.allocator.size,
            "context_length": self.context_length,
            "vocab_size": model.vocab_size,
            "num_layers": model.num_layers,
            "kv_bytes_per_token": kv_bytes,
            "kv_tokens_per_gib": (1 << 30) // kv_bytes,
        }


def default_pool_tokens(bytes_per_token: int, device: torch.device) -> int:
    """A quarter of free memory, at least 2k tokens, at most 32k on CPU (1.5 GB for SmolLM2
    in fp32: zero-filling more costs seconds at start) and 1M on CUDA."""
    if device.type == "cuda":
        free, cap = torch.cuda.mem_get_info(device)[0], 1 << 20
    else:
        free, cap = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), 1 << 15
    return int(min(max(free // 4 // bytes_per_token, 2048), cap))
