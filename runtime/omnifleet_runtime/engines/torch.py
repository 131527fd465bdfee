"""The `torch` engine: a stage that is an `nn.Module`.

`entrypoint` names `module:factory`; `factory(**engine_args["factory_kwargs"])`
returns the module, which is moved to `engine_args["device"]` (default: cuda
when available, else cpu) and put in eval mode. Each input item becomes one
forward call under `torch.inference_mode()`: a dict is passed as keyword
arguments, a list as positional arguments, anything else as the one argument.
`wire.Array` values in the inputs become tensors on the device; tensors in
the outputs become `wire.Array`s (raw bytes, zero-copy on the wire).

Control RPCs: `ping`, `sleep` (moves the weights to host memory and frees
the GPU cache), `wake_up` (moves them back), `empty_cache`.

torch (and numpy, to view tensor memory) are imported only here, lazily.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from typing import Any, AsyncIterator

from ..schema import Stage
from ..wire import Array, walk
from .base import Engine, EngineRequest, load_callable


class TorchEngine(Engine):
    def __init__(self, stage: Stage, replica: str):
        self.stage = stage
        self.replica = replica
        self.args = dict(stage.engine_args)
        self.max_concurrency = self.args.get("max_concurrency", 1)
        self.torch: Any = None
        self.module: Any = None
        self.device = "cpu"

    async def start(self) -> None:
        import torch  # heavy: only in the stage process that runs this engine

        self.torch = torch
        self.device = self.args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        factory = load_callable(self.stage.entrypoint)
        module = await asyncio.to_thread(factory, **self.args.get("factory_kwargs", {}))
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{self.stage.entrypoint} returned {type(module).__name__}, not an nn.Module")
        self.module = module.to(self.device).eval()

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        async for item in request.inputs:
            yield await asyncio.to_thread(self._forward, item)

    def _forward(self, item: Any) -> Any:
        torch = self.torch
        x = walk(item, self._to_tensor)
        with torch.inference_mode():
            if isinstance(x, dict):
                y = self.module(**x)
            elif isinstance(x, list):
                y = self.module(*x)
            else:
                y = self.module(x)
        return walk(y, self._from_tensor)

    def _to_tensor(self, v: Any) -> Any:
        if not isinstance(v, Array):
            return v
        torch = self.torch
        with warnings.catch_warnings():  # frames are read-only; we copy before anyone writes
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(v.data, dtype=torch.uint8) if len(v.data) else torch.empty(0, dtype=torch.uint8)
        t = flat.view(getattr(torch, v.dtype)).reshape(v.shape)
        return t.to(self.device) if self.device != "cpu" else t.clone()

    def _from_tensor(self, v: Any) -> Any:
        torch = self.torch
        if not isinstance(v, torch.Tensor):
            return v
        t = v.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # a view of the tensor's memory, no copy
        return Array(str(t.dtype).removeprefix("torch."), tuple(t.shape), memoryview(raw))

    async def control(self, method: str, args: dict[str, Any]) -> Any:
        torch = self.torch
        if method == "ping":
            return {"pong": True, "stage": self.stage.name, "replica": self.replica, "pid": os.getpid(),
                    "device": self.device}
        if method == "sleep":
            await asyncio.to_thread(self.module.to, "cpu")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return {"asleep": True}
        if method == "wake_up":
            await asyncio.to_thread(self.module.to, self.device)
            return {"asleep": False}
        if method == "empty_cache":
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return {"ok": True}
        raise ValueError(f"unsupported control method {method!r} for a torch stage")
