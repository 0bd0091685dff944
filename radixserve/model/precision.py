"""Which dtype ``--dtype auto`` and ``--quantization auto`` become, and why (logged and shown in /server_info).

bfloat16 halves the bytes every step reads (weights and K/V), but it only pays
where the CPU multiplies bf16 natively: AMX tiles or AVX512-BF16. Elsewhere
(AVX2, most AMD and ARM parts today) torch emulates bf16 matmuls in float32
with conversions and they run slower than float32 itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.model import paged_kernel
from radixserve.model.gguf_rows import ROW_TYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV pool's own dtype (SGLang's --kv-cache-dtype): auto = the model's. bfloat16 under float32
# weights holds twice the tokens per GiB, and the paged kernel reads half the bytes per key; the 8-bit pools
# (codes and one bfloat16 scale per token and head: memory/kv_pool.py) 1.94x bfloat16's, lossy: int8 (symmetric,
# max|x| / 127) read in place by the CPU kernels, fp8_e4m3 (max|x| / 448, vLLM's and SGLang's name) for CUDA, where
# attention gathers and widens a context either way (on CPU: ``kv_cache_dtype_device_error``).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
EIGHT_BIT_KV = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_dtype_error(requested: str) -> str | None:
    """Why ``requested`` is no pool dtype; None when it is one of KV_CACHE_DTYPES."""
    if requested in KV_CACHE_DTYPES:
        return None
    return f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {requested!r}"


def kv_cache_dtype_device_error(requested: str, device: torch.device, attention_backend: str) -> str | None:
    """Why the pool dtype ``requested`` cannot serve on ``device`` with ``attention_backend`` (as asked: auto on a
    CPU is the paged kernel wherever it builds); None when it can.

    The CPU's paged kernels read float32, bfloat16 and int8 pools in place; an fp8 pool there would have to be
    gathered and widened to float every layer (the reference backend), as CUDA's attention does with any pool."""
    if requested == "fp8_e4m3" and device.type == "cpu" and attention_backend != "reference":
        return (
            "kv_cache_dtype 'fp8_e4m3' on CPU needs --attention-backend reference (gather + SDPA: each context "
            "copied and widened every layer); the CPU kernels read int8 pools in place, in the same bytes: use int8"
        )
    return None


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for ``requested`` (one of KV_CACHE_DTYPES) under weights in ``model_dtype``."""
    error = kv_cache_dtype_error(requested)
    if error is not None:
        raise ValueError(error)
    if requested in EIGHT_BIT_KV:
        return EIGHT_BIT_KV[requested]
    return model_dtype if requested == "auto" else DTYPES[requested]


def cpu_flags() -> set[str]:
    """The kernel's cpuinfo flags for this CPU (avx2, avx512f, avx_vnni, amx_bf16, ...); empty outside Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    amx_bf16: bool
    avx512_bf16: bool

    @classmethod
    def detect(cls) -> CpuFeatures:
        """Ask torch, and the kernel's cpuinfo flags as a second opinion (Linux only)."""
        flags = cpu_flags()
        cpu = torch.cpu
        amx = bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()) or "amx_bf16" in flags
        avx512_bf16 = bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()) or "avx512_bf16" in flags
        return cls(torch.backends.cpu.get_cpu_capability(), amx, avx512_bf16)


def resolve_dtype(requested: str, device: torch.device, cpu: CpuFeatures | None = None) -> tuple[torch.dtype, str]:
    """(dtype, reason) for ``requested`` ("auto" or a DTYPES name) on ``device``."""
    if requested != "auto":
        return DTYPES[requested], f"{requested} as asked"
    if device.type == "cuda":
        return torch.bfloat16, "auto: bfloat16 on CUDA"
    cpu = cpu or CpuFeatures.detect()
    if cpu.amx_bf16:
        return torch.bfloat16, f"auto: bfloat16, the CPU has AMX-BF16 (torch capability {cpu.capability})"
    if cpu.avx512_bf16:
        return torch.bfloat16, f"auto: bfloat16, the CPU has AVX512-BF16 (torch capability {cpu.capability})"
    return torch.float32, (
        f"auto: float32, the CPU has neither AMX nor AVX512-BF16 (torch capability {cpu.capability}): "
        "bfloat16 matmuls would be emulated"
    )


# The storage types whose blocks the q4_1 path keeps as they are (quant_blocks.FILE_FORMATS), and every type a
# load keeps as the file stores it (those, and gguf_rows.ROW_TYPES: the K-quants, Q5_0 / Q5_1, F16 / BF16 / F32).
KEPT_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
KEPT_TYPES = (*KEPT_BLOCK_TYPES, *ROW_TYPES)


def resolve_quantization(
    requested: str, device: torch.device, matrix_types: Mapping[str, str] | None, block_kernel: bool | None = None
) -> tuple[str, str]:
    """(method, reason) for ``requested`` ("auto" or a QUANTIZATIONS name).

    auto keeps what the checkpoint stores, and only where that loses nothing and runs fast:
    ``matrix_types`` (HF name -> storage type of each matrix a forward multiplies by; None for an
    HF float checkpoint) with any KEPT_TYPES -> q4_1-exact (those weights as the file stores them, float
    activations), on a CPU where the block kernel builds (``block_kernel``; None: ask ``paged_kernel.load``).
    Matrices of other types are then dequantized to floats (the loader: ``float_rest``), not re-quantized. Else none.
    """
    if requested != "auto":
        return requested, f"{requested} as asked"
    if matrix_types is None:
        return "none", "auto: none, a float checkpoint (its weights as stored)"
    stored = Counter(matrix_types.values())
    listing = ", ".join(f"{count} {kind}" for kind, count in sorted(stored.items()))
    other = sorted(kind for kind in stored if kind not in KEPT_TYPES)
    if len(other) == len(stored):
        return "none", (
            f"auto: none, the GGUF stores its matrices as {listing}; {', '.join(other)} cannot stay as stored "
            "(q4_1 would re-quantize them: lossy), so every tensor is dequantized"
        )
    if device.type != "cpu":
        return "none", f"auto: none on {device.type}, the block kernel is CPU-only (GGUF matrices: {listing})"
    if block_kernel is None:
        block_kernel = paged_kernel.load()
    if not block_kernel:
        return "none", f"auto: none, the block kernel did not build (see the log; GGUF matrices: {listing})"
    # q4_1-exact, not q4_1: int8 activations are faster but lossy (docs: server/precision.md); auto loses nothing.
    q4_0 = " (Q4_0 by the Q4_1 kernels with m = -8d: the same values)" if "Q4_0" in stored else ""
    rest = f"; {', '.join(other)} have no kernel: dequantized to floats, lossless (never re-quantized)" if other else ""
    return "q4_1-exact", (
        f"auto: q4_1-exact, the GGUF stores its matrices as {listing}: kept as the file stores them, "
        f"lossless{q4_0}{rest}"
    )
