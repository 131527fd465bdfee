"""Stage engines, imported lazily so a stage loads only the one it runs."""

from __future__ import annotations

from ..schema import Stage
from .base import BadInput, Engine, EngineRequest, EngineStartError, load_callable

__all__ = ["BadInput", "Engine", "EngineRequest", "EngineStartError", "load_callable", "make_engine"]


def make_engine(stage: Stage, replica: str) -> Engine:
    if stage.type == "python":
        from .python import PythonEngine

        return PythonEngine(stage, replica)
    if stage.type == "torch":
        from .torch import TorchEngine

        return TorchEngine(stage, replica)
    if stage.type == "llm":
        from .vllm import VllmEngine

        return VllmEngine(stage, replica)
    if stage.type == "diffusion":
        from .diffusion import DiffusionEngine

        return DiffusionEngine(stage, replica)
    if stage.type == "vllm-omni":
        from .vllm_omni import VllmOmniEngine

        return VllmOmniEngine(stage, replica)
    raise NotImplementedError(f"stage {stage.name!r}: the {stage.type} engine is not available in this build")

