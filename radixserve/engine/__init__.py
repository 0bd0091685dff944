"""The engine: the step (forward + sample for one scheduled batch), the one loop that drives it (driver.py)
and ``Engine``, which wires them to a model."""

from __future__ import annotations

from radixserve.engine.config import DTYPES, EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.step import StepExecutor

__all__ = ["DTYPES", "Engine", "EngineConfig", "StepExecutor"]
