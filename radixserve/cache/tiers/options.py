"""What the tiers need of the layers above the cache, as plain data the engine hands in.

The cache layer never imports the engine or the model: ``TierConfig`` copies the
engine options that shape the tiers by field name, and ``ModelIdentity`` is what
the cache directory's fingerprint reads of the loaded model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TierConfig:
    """The options that shape the tiers, named (and validated) as ``EngineConfig`` names them."""

    page_size: int = 1  # the cache's page; a tier page is the smallest multiple of it holding 16 tokens
    hicache_size: float = 0.0  # GiB of host memory (L2); 0: no L2
    hicache_write_policy: str = "write_back"  # write_back | write_through (store.py)
    hicache_compress: bool = False  # int8 L2 pages: ~4x tokens per GiB, lossy
    cache_dir: str | None = None  # the disk tier's directory (L3); None: no L3
    cache_dir_size: float | None = None  # GiB the disk tier may use; None: unbounded

    @classmethod
    def of(cls, options: object) -> TierConfig:
        """The same-named fields of ``options`` (an ``EngineConfig``), copied."""
        return cls(**{field.name: getattr(options, field.name) for field in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ModelIdentity:
    """What the fingerprint reads of the loaded model."""

    path: str  # the model's file or folder: its bytes are hashed
    quantization: str  # resolved: auto on another file or machine may differ
    encode: Callable[[str], Sequence[int]]  # the tokenizer: how it encodes a probe text is hashed
