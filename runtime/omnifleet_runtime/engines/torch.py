"""The `torch` engine: a stage that is an `nn.Module`.

`entrypoint` names `module:factory`; `factory(**engine_args["factory_kwargs"])`
returns the module (a factory with a `model` parameter that factory_kwargs do
not set gets the stage's model, `stages[].model` or `spec.model`, `$VAR`s
expanded), which is moved to `engine_args["device"]` (default: cuda
when available, else cpu) and put in eval mode. Each input item becomes one
forward call under `torch.inference_mode()`: a dict is passed as keyword
arguments, a list as positional arguments, anything else as the one argument.
`wire.Array` values in the inputs become tensors on the device; tensors in
the outputs become `wire.Array`s (raw bytes, zero-copy on the wire).

Batching: a module with a `forward_batch(items)` method, in a stage whose
`max_concurrency` is above 1, gets the items of concurrent requests together:
one call with the list of every item queued when the previous call returned
(at most max_concurrency; no item waits for a batch to fill), each item as
forward would get its arguments. It returns a list as long, of outputs, or of
exceptions that fail only their own request. A request aborted while its item
waits is left out of the next call; one aborted during a call has its output
dropped.

CUDA tensors in the outputs stay on the GPU until a route takes them: a
co-located torch stage gets a CUDA IPC handle (`wire.CudaIpc`, torch's own
sharing: the producer's memory stays allocated until the consumer's tensor
is freed, then goes back to the producer's cache), every other route a host
copy made in a worker thread, into pinned memory that torch's caching host
allocator reuses once the wire has sent it. The consumer's tensor is the producer's
memory: a module that writes into its input writes there (the producer has
let it go). A handle whose request is dropped unread is released; one queued
in an aborted request is reclaimed when the producer's allocator runs short
(torch frees IPC memory its consumers let go before failing an allocation).
On a GPU, large inputs that cross split over several connections are
reassembled into pinned host memory (`host_buffers`), so their copy to the
device reads locked pages at DMA speed.

Control RPCs: `ping`, `sleep` (moves the weights to host memory and frees
the GPU cache), `wake_up` (moves them back), `empty_cache`.

torch (and numpy, to view tensor memory) are imported only here, lazily.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import warnings
from typing import Any, AsyncIterator, Callable

from ..handoff import Threads
from ..schema import Stage
from ..wire import Array, CudaIpc, walk
from .base import BadInput, Engine, EngineRequest, load_callable


class TorchEngine(Engine):
    def __init__(self, stage: Stage, replica: str):
        self.stage = stage
        self.replica = replica
        self.args = dict(stage.engine_args)
        self.max_concurrency = self.args.get("max_concurrency", 1)
        self.torch: Any = None
        self.module: Any = None
        self.device = "cpu"
        self.queue: list[tuple[Any, asyncio.Future]] = []  # items waiting for the next batch
        self.queued = asyncio.Event()
        self.batcher: asyncio.Task | None = None
        self.threads = Threads(f"stage-{stage.name}", int(self.max_concurrency or 1))

    async def start(self) -> None:
        import torch  # heavy: only in the stage process that runs this engine

        self.torch = torch
        self.device = self.args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        factory = load_callable(self.stage.entrypoint)
        kwargs = dict(self.args.get("factory_kwargs", {}))
        if "model" not in kwargs and self.stage.model and "model" in _parameters(factory):
            from .vllm import expand_model  # imports nothing of vLLM's

            kwargs["model"] = expand_model(self.stage)
        module = await asyncio.to_thread(factory, **kwargs)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{self.stage.entrypoint} returned {type(module).__name__}, not an nn.Module")
        self.module = module.to(self.device).eval()
        if int(self.max_concurrency or 0) > 1 and callable(getattr(module, "forward_batch", None)):
            self.batcher = asyncio.get_running_loop().create_task(self._batches())

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        async for item in request.inputs:
            if self.batcher is None:
                out = await self.threads.run(self._forward, item)
            else:
                done = asyncio.get_running_loop().create_future()
                self.queue.append((item, done))
                self.queued.set()
                out = await done  # an abort cancels it, so the batcher leaves the item out
            request.last = request.inputs_ended()  # one output per input
            yield out

    async def _batches(self) -> None:
        while True:
            await self.queued.wait()
            self.queued.clear()
            batch = [(x, f) for x, f in self.queue if not f.done()]
            self.queue.clear()
            if not batch:
                continue
            try:
                outs = await self.threads.run(self._forward_batch, [x for x, _ in batch])
            except Exception as e:  # the call itself failed: every request in it fails with its reason
                outs = [e] * len(batch)
            for (_, f), y in zip(batch, outs):
                if not f.done():
                    f.set_exception(y) if isinstance(y, BaseException) else f.set_result(y)

    def _forward_batch(self, items: list[Any]) -> list[Any]:
        outs: list[Any] = [None] * len(items)
        args = []
        for i, x in enumerate(items):
            try:
                args.append((i, walk(x, self._to_tensor)))
            except Exception as e:  # an input this process cannot take fails its own request only
                outs[i] = e
        if not args:
            return outs
        with self.torch.inference_mode():
            ys = self.module.forward_batch([a for _, a in args])
        if not isinstance(ys, (list, tuple)) or len(ys) != len(args):
            got = len(ys) if isinstance(ys, (list, tuple)) else type(ys).__name__
            raise RuntimeError(f"stage {self.stage.name}: forward_batch of {len(args)} items returned {got}, "
                               "not a list as long")
        for (i, _), y in zip(args, ys):
            outs[i] = y if isinstance(y, BaseException) else walk(y, self._from_tensor)
        return outs

    async def shutdown(self) -> None:
        if self.batcher is not None:
            self.batcher.cancel()
        self.threads.close()

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
        if isinstance(v, CudaIpc):
            t = self._from_ipc(v)
            return t if self.device == "cpu" or t.device == self.torch.device(self.device) else t.to(self.device)
        if not isinstance(v, Array):
            return v
        torch = self.torch
        with warnings.catch_warnings():  # frames are read-only; we copy before anyone writes
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(v.data, dtype=torch.uint8) if len(v.data) else torch.empty(0, dtype=torch.uint8)
        t = flat.view(getattr(torch, v.dtype)).reshape(v.shape)
        return t.to(self.device) if self.device != "cpu" else t.clone()

    def _from_tensor(self, v: Any) -> Any:
        """Outputs: CUDA tensors stay on the device (export decides per route), others become Arrays."""
        torch = self.torch
        if not isinstance(v, torch.Tensor):
            return v
        return v.detach() if v.is_cuda else self._host(v)

    def _host(self, v: Any) -> Any:
        torch = self.torch
        if not isinstance(v, torch.Tensor):
            return v
        if v.is_cuda:  # into pinned memory (torch's caching host allocator: reused once the wire lets go)
            t = torch.empty(tuple(v.shape), dtype=v.dtype, pin_memory=True)
            t.copy_(v.detach())
        else:
            t = v.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # a view of the tensor's memory, no copy
        return Array(str(t.dtype).removeprefix("torch."), tuple(t.shape), memoryview(raw))

    def host_buffers(self) -> Callable[[int], Any] | None:
        # Inputs reassembled into pinned memory copy to the GPU at DMA speed (about 3x pageable memory on an
        # H200); torch's caching host allocator keeps the blocks, as it does for the outputs' host copies.
        return self._pinned if self.torch.device(self.device).type == "cuda" else None

    def _pinned(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.uint8, pin_memory=True).numpy()

    def _has_cuda(self, value: Any) -> bool:
        found = False

        def leaf(v: Any) -> None:
            nonlocal found
            found = found or (isinstance(v, self.torch.Tensor) and v.is_cuda)

        walk(value, leaf)
        return found

    async def export(self, value: Any, cuda_ipc: bool) -> Any:
        if self.torch is None or not self._has_cuda(value):
            return value
        if cuda_ipc:
            self.torch.cuda.ipc_collect()  # memory of earlier handles whose consumers let go returns to the cache
            return walk(value, self._to_ipc)
        return await asyncio.to_thread(walk, value, self._host)  # D2H off the event loop

    def _to_ipc(self, v: Any) -> Any:
        torch = self.torch
        if not (isinstance(v, torch.Tensor) and v.is_cuda):
            return v
        from torch.multiprocessing.reductions import reduce_tensor

        (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, _, rc_handle,
         rc_offset, event_handle, event_sync) = reduce_tensor(v.detach())[1]
        return CudaIpc(device, bytes(handle), storage_size, storage_offset, bytes(rc_handle), rc_offset,
                       None if event_handle is None else bytes(event_handle), bool(event_sync),
                       str(dtype).removeprefix("torch."), tuple(size), tuple(stride), offset)

    def _from_ipc(self, v: CudaIpc) -> Any:
        torch = self.torch
        if not torch.cuda.is_available():
            raise BadInput(f"stage {self.stage.name}: a CUDA tensor came by IPC handle, but this process sees no GPU")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(v.shape), v.stride, v.offset, torch.UntypedStorage, getattr(torch, v.dtype),
            v.device, v.handle, v.storage_size, v.storage_offset, False, v.ref_counter_handle,
            v.ref_counter_offset, v.event_handle, v.event_sync)

    def release(self, value: Any) -> None:
        torch = self.torch
        if torch is None:
            return

        def leaf(v: Any) -> None:
            if isinstance(v, CudaIpc):
                try:
                    torch.UntypedStorage._release_ipc_counter(v.ref_counter_handle, v.ref_counter_offset,
                                                              device=v.device)
                except Exception as e:  # a handle of a producer that is gone: nothing left to release
                    warnings.warn(f"could not release a CUDA IPC handle: {e}", RuntimeWarning)

        walk(value, leaf)

    async def control(self, method: str, args: dict[str, Any]) -> Any:
        torch = self.torch
        if method == "ping":
            cuda = self.device != "cpu" and torch.cuda.is_available()
            return {"pong": True, "stage": self.stage.name, "replica": self.replica, "pid": os.getpid(),
                    "device": self.device, "cuda_allocated_bytes": torch.cuda.memory_allocated() if cuda else None}
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


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a callable whose signature Python cannot tell (a builtin)
        return set()
