"""The `python` engine: a stage that is a user callable.

The stage's `entrypoint` names `module:callable` with the signature

    fn(inputs, sampling_params: dict, context: StageContext)

called once per input item: once per request for a stage in `whole` input
mode (or the entry stage), once per upstream chunk in `stream` mode, in
order, with the same `context` (keep per-request state in `context.state`).
It may be a plain function (its return value is one output chunk), a
generator (each yielded value is a chunk, streamed downstream as it comes),
or the async variant of either. A `None` result or yield emits nothing.
Plain functions and generators run in worker threads, so they may block.

Chunks are what msgpack can carry: None, bool, int, float, str, bytes,
lists and dicts of them, and `omnifleet_runtime.wire.Array` for raw arrays.
Large bytes arrive downstream as read-only memoryviews (zero-copy).

Control RPCs: `ping` is built in; for anything else, define
`omnifleet_control(method: str, args: dict)` (sync or async) in the
entrypoint's module. A stage that drives something that can die on its own
(a server process it started) defines `omnifleet_dead()` there: a reason
string once it can serve no more, else None; polled often, it must not block.

engine_args: `max_concurrency` (requests let into the callable at once).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..handoff import Threads
from ..schema import Stage
from ..wire import RequestInfo
from .base import Engine, EngineRequest, load_callable

_END = object()


@dataclass
class StageContext:
    request_id: str
    stage: str
    replica: str  # the pod name
    request: RequestInfo
    chunk_index: int = 0  # which input item this call handles
    state: dict[str, Any] = field(default_factory=dict)  # kept across the calls of one request


class PythonEngine(Engine):
    def __init__(self, stage: Stage, replica: str):
        self.stage = stage
        self.replica = replica
        self.max_concurrency = stage.engine_args.get("max_concurrency")
        self.fn: Any = None
        self.kind = ""  # "asyncgen", "coroutine" or "plain": what fn is, read once
        self.dead_hook: Any = None
        self.threads = Threads(f"stage-{stage.name}", self.max_concurrency)

    async def start(self) -> None:
        self.fn = load_callable(self.stage.entrypoint)
        if not callable(self.fn):
            raise TypeError(f"{self.stage.entrypoint} is not callable")
        self.kind = ("asyncgen" if inspect.isasyncgenfunction(self.fn) else
                     "coroutine" if inspect.iscoroutinefunction(self.fn) else "plain")
        module = importlib.import_module(self.stage.entrypoint.partition(":")[0])
        self.dead_hook = getattr(module, "omnifleet_dead", None)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        ctx = StageContext(request.request_id, self.stage.name, self.replica, request.info)
        fn, sp, kind = self.fn, request.sampling_params, self.kind
        async for item in request.inputs:
            if kind == "asyncgen":
                async for out in fn(item, sp, ctx):
                    if out is not None:
                        yield out
            elif kind == "coroutine":
                out = await fn(item, sp, ctx)
                if out is not None:
                    request.last = request.inputs_ended()
                    yield out
            else:
                out = await self.threads.run(fn, item, sp, ctx)
                if inspect.isgenerator(out):
                    async for x in _drain_in_thread(out, self.threads):
                        if x is not None:
                            yield x
                elif out is not None:
                    request.last = request.inputs_ended()
                    yield out
            ctx.chunk_index += 1

    async def shutdown(self) -> None:
        self.threads.close()

    def dead(self) -> str | None:
        hook = self.dead_hook
        return hook() if hook is not None else None

    async def control(self, method: str, args: dict[str, Any]) -> Any:
        if method == "ping":
            return {"pong": True, "stage": self.stage.name, "replica": self.replica, "pid": os.getpid()}
        module = importlib.import_module(self.stage.entrypoint.partition(":")[0])
        hook = getattr(module, "omnifleet_control", None)
        if hook is None:
            raise ValueError(f"unsupported control method {method!r} (define omnifleet_control(method, args) "
                             f"in {module.__name__} to handle it)")
        result = hook(method, args)
        return await result if inspect.isawaitable(result) else result


async def _drain_in_thread(gen, threads: Threads) -> AsyncIterator[Any]:
    try:
        while (x := await threads.run(next, gen, _END)) is not _END:
            yield x
    finally:
        try:
            gen.close()
        except ValueError:  # still running in its thread (we were cancelled); it stops at its next yield
            pass
