"""Stock callables for `python` stages (`entrypoint: omnifleet_runtime.stock:NAME`).

Same signature as any python stage: `fn(inputs, sampling_params, context)`.
"""

from __future__ import annotations

from typing import Any


def passthrough(inputs: Any, sampling_params: dict, context: Any) -> Any:
    """Hand the input on unchanged: a CPU stage in front of an LLM fleet (a place for request
    pre-processing, scaled on its own), or a stand-in while a pipeline is being laid out."""
    return inputs
