"""EngineConfig: everything that shapes an engine, validated at construction."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache import EVICTION_POLICIES, PREFIX_CACHES, WRITE_POLICIES
from radixserve.model.invariance import INVARIANT_KERNELS, amx_available
from radixserve.model.paged_kernel import ATTENTION_BACKENDS
from radixserve.model.precision import DTYPES as DTYPES  # re-exported: server/args.py builds --dtype from it
from radixserve.model.precision import kv_cache_dtype_device_error, kv_cache_dtype_error, resolve_dtype
from radixserve.model.quant import QUANTIZATIONS
from radixserve.scheduler.draft import SPEC_SOURCES
from radixserve.scheduler.policy import SCHEDULE_POLICIES

SPECULATIVE_ALGORITHMS = ("ngram",)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine; validated here, unknown options are an error."""

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    chat_template: str | None = None  # a Jinja file that replaces the model's own chat template
    prefix_cache: str = "radix"  # radix | block | none
    page_size: int = 1
    radix_eviction_policy: str = "lru"
    schedule_policy: str = "fcfs"  # fcfs | lpm | dfs-weight | lof | random | routing-key | priority | hrrn
    in_batch_dedup: bool = True  # hold requests whose shared uncached prefix a sibling is computing
    schedule_seed: int = 0  # schedule_policy=random: the same seed gives the same order
    max_total_tokens: int | None = None  # KV pool size in tokens; None: a share of free memory
    max_running_requests: int = 64
    chunked_prefill_size: int = 8192  # prefill tokens per step; longer prompts go in chunks
    enable_mixed_chunk: bool = False  # one forward per step: the prefill chunk and every running decode
    # Speculative decoding without a draft model (scheduler/draft.py): None (off) | ngram (drafts from the prefix
    # cache's sequences and the request's own text, verified in the step's one forward)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 8  # the most tokens drafted for one request per step
    speculative_ngram_source: str = "both"  # both | tree (the prefix cache) | prompt (the request's own text)
    # A verify row's cost in one-row decode steps, for the drafter's pricing: None measures what forwards of 1 ..
    # num_draft_tokens + 1 rows cost at start (engine/spec_costs.py); a number fixes it (reproducible drafting)
    speculative_row_cost: float | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with AMX / AVX512-BF16, else float32
    kv_cache_dtype: str = "auto"  # auto (= dtype) | float32 | bfloat16 | int8 | fp8_e4m3: the KV pool's own dtype
    # auto: a GGUF's own Q4_0/Q4_1/Q8_0 blocks with float activations (q4_1-exact, lossless) where it stores only
    # those and the CPU block kernel runs, else none | none | int8 (weight-only, per-channel scales) |
    # q4_1 (GGUF-style blocks, int8 activations as llama.cpp) | q4_1-exact (the same, float activations)
    quantization: str = "auto"
    attention_backend: str = "auto"  # auto | paged (in place, CPU kernel) | reference (gather + SDPA)
    # A token's logits never depend on how many rows share its step (a cache hit, a chunk boundary, batch
    # companions): the block linears run their own kernel at any row count (quant_blocks.make_split_invariant).
    # Off: prefill rows go through the vendor GEMM (faster on AMX; a cache hit can change an answer).
    split_invariant: bool = True
    # vector: the block decode kernel at every row count | amx: bfloat16 rows on AMX tiles (prefill near the GEMM's
    # speed, block linears' decode ~2x slower; needs AMX-BF16)
    split_invariant_kernel: str = "vector"
    device: str = "auto"  # auto: cuda when present, else cpu
    num_threads: int = 1  # torch CPU threads: 1 is the safe default on a small shared box
    enable_kv_events: bool = False
    # Tiers below the KV pool (radix cache only); all off by default: the pool is the only tier.
    hicache_size: float = 0.0  # GiB of host memory (L2) for pages the pool evicts; 0: no L2
    hicache_write_policy: str = "write_back"  # write_back | write_through (see cache/tiers/store.py)
    hicache_compress: bool = False  # int8 L2 pages with per-page scales: ~4x tokens per GiB, lossy
    cache_dir: str | None = None  # a directory for the disk tier (L3); survives restarts
    cache_dir_size: float | None = None  # GiB the disk tier may use; None: unbounded

    def __post_init__(self) -> None:
        valid_device = self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        device = self.resolved_device() if valid_device else None  # fp8 pools need the reference backend on CPU
        kv_device_error = (
            None if device is None else kv_cache_dtype_device_error(self.kv_cache_dtype, device, self.attention_backend)
        )
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
            (kv_cache_dtype_error(self.kv_cache_dtype) is None, kv_cache_dtype_error(self.kv_cache_dtype) or ""),
            (kv_device_error is None, kv_device_error or ""),
            (
                self.quantization == "auto" or self.quantization in QUANTIZATIONS,
                f"quantization must be one of {('auto', *QUANTIZATIONS)}",
            ),
            (
                self.split_invariant_kernel in INVARIANT_KERNELS,
                f"split_invariant_kernel must be one of {INVARIANT_KERNELS}",
            ),
            (  # before any weight is read (a usage error of the flags, not a traceback after the load)
                self.split_invariant_kernel != "amx" or not self.split_invariant or amx_available(),
                "split_invariant_kernel amx needs a CPU (and kernel build) with AMX-BF16; use vector",
            ),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (valid_device, "device: auto|cpu|cuda[:N]"),
            (self.num_threads >= 1, "num_threads must be >= 1"),
            (self.speculative_algorithm in (None, *SPECULATIVE_ALGORITHMS), "speculative_algorithm: None or ngram"),
            (1 <= self.speculative_num_draft_tokens <= 16, "speculative_num_draft_tokens must be 1..16"),
            (self.speculative_ngram_source in SPEC_SOURCES, f"speculative_ngram_source: one of {SPEC_SOURCES}"),
            (
                self.speculative_row_cost is None or 0 <= self.speculative_row_cost <= 4,
                "speculative_row_cost: None (measured) or 0..4 decode steps",
            ),
            (
                self.chat_template is None or os.path.isfile(self.chat_template),
                f"chat_template {self.chat_template!r} is not a file (a Jinja chat template)",
            ),
            (self.hicache_size >= 0, "hicache_size must be >= 0 (GiB)"),
            (self.hicache_write_policy in WRITE_POLICIES, f"hicache_write_policy must be one of {WRITE_POLICIES}"),
            (self.cache_dir_size is None or self.cache_dir_size > 0, "cache_dir_size must be > 0 (GiB)"),
            (
                self.prefix_cache == "radix" or (not self.hicache_size and self.cache_dir is None),
                "hicache_size and cache_dir need prefix_cache radix",
            ),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config from options named as ``radixserve serve``'s flags: every field by its name, and
        SGLang's ``disable_radix_cache`` / ``disable_in_batch_dedup`` switches (``ALIASES``) as well.

        ``Engine(**options)`` and the flags (server/args.py) both come here. An unknown option is a
        TypeError, a bad value a ValueError.
        """
        for alias, (name, value) in ALIASES.items():
            if options.pop(alias, False):
                options[name] = value
        return cls(**options)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> tuple[torch.dtype, str]:
        """(dtype, why): auto asks the CPU whether it multiplies bfloat16 natively."""
        return resolve_dtype(self.dtype, device)


# Options that set a field another way, as SGLang names them: option -> (field, its value when the option is on)
ALIASES: dict[str, tuple[str, Any]] = {
    "disable_radix_cache": ("prefix_cache", "none"),
    "disable_in_batch_dedup": ("in_batch_dedup", False),
}
ENGINE_OPTIONS = frozenset({f.name for f in dataclasses.fields(EngineConfig)} | set(ALIASES))


def default_pool_tokens(bytes_per_token: int, device: torch.device) -> int:
    """A quarter of free memory, at least 2k tokens, at most 32k on CPU (1.5 GB for SmolLM2
    in fp32: zero-filling more costs seconds at start) and 1M on CUDA."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        cap = 1 << 20
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cap = 1 << 15
    return int(min(max(free // 4 // bytes_per_token, 2048), cap))
