"""Stage engines, imported lazily so a stage loads only the one it runs."""

from __future__ import annotations

from ..schema import Stage
from .base import Engine, EngineRequest, EngineStartError, load_callable

__all__ = ["Engine", "EngineRequest", "EngineStartError", "load_callable", "make_engine"]


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
        raise EngineStartError(VLLM_OMNI_MISSING.format(stage=stage.name))
    raise NotImplementedError(f"stage {stage.name!r}: the {stage.type} engine is not available in this build")


# What a vllm-omni stage needs that this build lacks; said at stage start and by `omnifleet run`.
VLLM_OMNI_MISSING = (
    "stage {stage!r} is a vllm-omni stage, and this build has no vllm-omni engine: running it needs "
    "vLLM-Omni's stage engines (vllm-omni 0.30 with vLLM 0.30 in the stage image) behind an "
    "omnifleet_runtime.engines.vllm_omni module, which is not written yet; the importer only renders such stages"
)
