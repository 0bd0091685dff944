"""Our C++ CPU kernels (csrc/): in-place paged attention and the int8 linear; built once per machine.

``make install`` builds it (``python -m radixserve.model.paged_kernel``); at run
time ``load()`` finds the build in torch's extension folder, or builds it then.
Where no C++ compiler is present, or the build fails, ``load()`` returns False
and attention falls back to the reference gather + SDPA path (int8 linears to
torch's ``_weight_int8pack_mm``).

The build is named after a fingerprint of the CPU's feature flags (it is
compiled with ``-march=native``: a home folder shared with a machine of
another CPU must not hand that machine an illegal instruction), torch's
version, the compile flags and every file under csrc/. It compiles a copy of
csrc/ kept in its own build folder, never the checkout's files: torch's build
files name the sources by absolute path, so two checkouts (worktrees, a CI
clone) with the same sources would otherwise rebuild each other's library,
and with different ones they get different folders.

Each load stamps its folder as used; a new build removes the builds no process
has loaded for ``STALE_AFTER_DAYS`` (every source edit or upgrade leaves one
behind, ~2 MB each).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixserve.model.attention_params import DEFAULT_PARAMS, AttentionParams
from radixserve.model.shared_prefix import SharedPrefixes, find_shared_prefixes

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_attention.cpp",
    CSRC / "paged_attention.h",
    CSRC / "paged_avx2.h",
    CSRC / "int8_linear.cpp",
    CSRC / "block_linear.cpp",
    CSRC / "block_q8_linear.cpp",
    CSRC / "block_gemm.cpp",
    CSRC / "tiled_gemm.h",
    CSRC / "gguf_rows.h",
    CSRC / "gguf_rows_linear.cpp",
    CSRC / "gguf_rows_q8_linear.cpp",
    CSRC / "block_amx.cpp",
    CSRC / "extend_attention.cpp",
    CSRC / "fused_ops.cpp",
)


CFLAGS = ("-O3", "-march=native", "-fopenmp")
PREFIX = "radixserve_paged_"
STALE_AFTER_DAYS = 14


def build_fingerprint(csrc: Path = CSRC) -> str:
    """What the built library depends on: CPU flags, torch, compile flags, the SOURCES it compiles, each csrc/
    file's name and bytes (a build made while a new file sat in csrc/ unlisted is not reused once it is listed).

    Not where the checkout lies: the same sources anywhere share one build."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = "unknown"
    digest = hashlib.sha256("\0".join((flags, torch.__version__, *CFLAGS, *(p.name for p in SOURCES))).encode())
    for path in sorted(p for p in csrc.iterdir() if p.is_file()):
        data = path.read_bytes()
        digest.update(f"\0{path.name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:12]


def build_directory(name: str) -> Path:
    """The folder extension ``name`` is built in (created): ``TORCH_EXTENSIONS_DIR`` if set, else torch's
    cache folder. Worked out here rather than asked of torch.utils.cpp_extension, whose import (0.35 s:
    setuptools) a kernel that is built already does not need; the build is told this folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "torch_extensions", f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def stage_sources(build_dir: Path, csrc: Path = CSRC) -> Path:
    """csrc/ copied into ``build_dir/src`` once, atomically, and never rewritten (a newer file would
    make ninja rebuild the library other processes have loaded). The folder is named by the sources'
    fingerprint, so what is there already is these sources."""
    staged = build_dir / "src"
    if not staged.is_dir():
        scratch = Path(tempfile.mkdtemp(prefix="src.", dir=build_dir))
        for path in csrc.iterdir():
            if path.is_file():
                shutil.copyfile(path, scratch / path.name)
        try:
            os.rename(scratch, staged)
        except OSError:  # another process staged them first: keep its copy
            shutil.rmtree(scratch, ignore_errors=True)
    return staged


def mark_used(build_dir: Path) -> None:
    """Stamp ``build_dir`` as loaded now (its ``used`` file's mtime); a read-only cache stays unstamped."""
    try:
        (build_dir / "used").touch()
    except OSError:
        pass


def prune_stale_builds(keep: Path, max_age_days: float = STALE_AFTER_DAYS) -> list[Path]:
    """Remove the other builds beside ``keep`` that no load has stamped for ``max_age_days`` (the
    library's own mtime stands in for a build never stamped); one being built (torch's lock file) stays.
    Returns what was removed. A process that still has a removed library loaded keeps its mapping."""
    cutoff = time.time() - max_age_days * 86400
    removed = []
    for other in keep.parent.glob(f"{PREFIX}*"):
        if other == keep or not other.is_dir() or (other / "lock").exists():
            continue
        stamps = [p.stat().st_mtime for p in (other / "used", other / f"{other.name}.so") if p.exists()]
        if max(stamps, default=other.stat().st_mtime) < cutoff:
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
    if removed:
        logger.info("removed %d kernel builds unused for %g days", len(removed), max_age_days)
    return removed


def _load_built(library: Path) -> bool:
    """Load a finished build as it is: its folder is named by everything it was built from, so it is
    current (torch's build step would import cpp_extension, check the compiler and run ninja to find
    nothing to do: 0.4 s). False when there is none, a build is running (torch's lock file), or it does
    not load: then build as usual."""
    if not library.is_file() or (library.parent / "lock").exists():
        return False
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except OSError:
        return False
    return True


@functools.cache
def load() -> bool:
    """True once ``torch.ops.radixserve.paged_attention`` and ``.int8_linear`` are usable.

    False (logged once) where they cannot be built."""
    try:
        name = f"{PREFIX}{build_fingerprint()}"
        build_dir = build_directory(name)
        if _load_built(build_dir / f"{name}.so"):
            mark_used(build_dir)
            return True
        from torch.utils import cpp_extension

        staged = stage_sources(build_dir)
        cpp_extension.load(
            name=name,
            sources=[str(staged / p.name) for p in SOURCES if p.suffix == ".cpp"],
            extra_cflags=list(CFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        mark_used(build_dir)
        prune_stale_builds(build_dir)
    except Exception as exc:  # no compiler, no ninja, a compile error: the reference path still works
        logger.warning("paged attention kernel unavailable, using gather + SDPA: %s", str(exc).splitlines()[0])
        return False
    return True


ATTENTION_BACKENDS = ("auto", "paged", "reference")


def resolve_backend(requested: str, device: torch.device) -> str:
    """auto: "paged" on CPU where the kernel builds, else "reference". An explicit "paged" that cannot run raises."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "reference":
        return requested
    usable = device.type == "cpu" and load()
    if requested == "paged" and not usable:
        raise ValueError("attention_backend 'paged' needs a CPU device and the built kernel (see the log)")
    return "paged" if usable else "reference"


@dataclass(frozen=True)
class PagedIndex:
    """Where each request's query rows and context slots lie, built once per step (CPU int64).

    Request b: rows q_starts[b] .. q_starts[b+1] of q, context slots[ctx_starts[b] .. ctx_starts[b+1]].
    ``shared``: groups of requests whose contexts start with the same slots (shared_prefix.py),
    read once per step for the whole group; empty when ``build`` was told ``cascade=False``.
    """

    slots: torch.Tensor
    q_starts: torch.Tensor
    ctx_starts: torch.Tensor
    num_splits: int  # a decode request's context is cut in up to this many pieces, one per work item
    shared: SharedPrefixes = SharedPrefixes.none()

    @functools.cached_property
    def shared_tensors(self) -> tuple[torch.Tensor, ...]:
        """``shared`` as the kernel's tensors: made once per step, not once per layer."""
        return tuple(torch.from_numpy(part) for part in self.shared)

    @classmethod
    def build(
        cls,
        context_slots: list[torch.Tensor],
        extend_lens: list[int],
        cascade: bool = True,
        solo: list[bool] | None = None,
    ) -> PagedIndex:
        """``solo``: per request, never in a shared-prefix group (read as a request alone reads it)."""
        ctx_lens = [int(slots.shape[0]) for slots in context_slots]
        starts = torch.tensor([0, *itertools.accumulate(extend_lens)], dtype=torch.int64)
        ctx_starts = torch.tensor([0, *itertools.accumulate(ctx_lens)], dtype=torch.int64)
        slots = torch.cat(context_slots).to("cpu", torch.int64) if context_slots else torch.zeros(0, dtype=torch.int64)
        shared = SharedPrefixes.none()
        if cascade and len(extend_lens) >= 2:
            lens = np.asarray(extend_lens, dtype=np.int64)
            shared = find_shared_prefixes(slots.numpy(), ctx_starts.numpy(), lens, solo=solo)
        # Enough work items for every thread: split contexts when requests x heads are few.
        threads = torch.get_num_threads()
        num_splits = 1 if threads == 1 else max(1, 2 * threads // max(1, len(extend_lens)))
        return cls(slots, starts, ctx_starts, num_splits, shared)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    index: PagedIndex,
    params: AttentionParams = DEFAULT_PARAMS,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [T, H, D] against K/V [Hkv, N, D] read in place at ``index`` -> [T, H, D] in q's dtype (causal per request;
    ``params``: the layer's window, soft cap and scale; with a window only the keys in it are read). ``scales``: an
    8-bit pool's (k_scale, v_scale), bfloat16 [Hkv, N], with int8 K/V."""
    out: torch.Tensor = torch.ops.radixserve.paged_attention.default(
        q.contiguous(),
        k_pool,
        v_pool,
        index.slots,
        index.q_starts,
        index.ctx_starts,
        *index.shared_tensors,
        index.num_splits,
        params.kernel_scale(q.shape[-1]),
        params.window,
        params.softcap,
        *(scales or (None, None)),
    )
    return out


@functools.cache
def extend_kernel_built() -> bool:
    """The library loads and was compiled for AVX512-BF16 (extend_attention.cpp; else its op refuses)."""
    return load() and bool(torch.ops.radixserve.extend_attention_supported())


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    index: PagedIndex,
    params: AttentionParams = DEFAULT_PARAMS,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """bf16 q [T, H, D] against bf16 K/V [Hkv, N, D] read at ``index`` -> [T, H, D] bf16 (causal per request); or
    int8 K/V with their ``scales`` (an 8-bit pool: each key packed as code * scale in bf16).

    Multi-token rows (prefill chunks, a cache hit's tail) with AVX512-BF16 dot products; a row's result
    does not depend on how its prompt was split into chunks or cached (csrc/extend_attention.h), with or
    without the window and soft cap of ``params``."""
    out: torch.Tensor = torch.ops.radixserve.extend_attention.default(
        q,
        k_pool,
        v_pool,
        index.slots,
        index.q_starts,
        index.ctx_starts,
        params.kernel_scale(q.shape[-1]),
        params.window,
        params.softcap,
        *(scales or (None, None)),
    )
    return out


if __name__ == "__main__":
    ok = load()
    print("paged attention kernel:", "built" if ok else "unavailable (gather + SDPA fallback)")
    sys.exit(0)
