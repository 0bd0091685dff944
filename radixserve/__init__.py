"""radixserve: an LLM serving engine built around a radix-tree prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixserve.engine import Engine


def __getattr__(name: str) -> Any:
    # Lazy: importing radixserve.cache must not pull in torch and transformers.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
