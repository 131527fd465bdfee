"""Classifier-free-guidance companions: requests a stage runs beside a request, on the same replica.

A stage with `promptExpand: module:fn` calls `fn(item, sampling_params, request)` on its input (the
client request at the entry stage, the whole upstream output elsewhere) and gets the companions: a
list of dicts `{"role", "input"}` plus optional `"sampling_params"` (overrides of the request's own).
Each runs on this replica's engine as request `<id>__<role>`, at the same time as the request itself:
a CFG pair shares one engine (vLLM-Omni pins a companion to its parent's replica for the same reason:
the stage that combines them needs both, made alike). Their chunks go to the same downstream stages,
where an input processor sees them as input `<stage>:<role>` (processors.ar_to_diffusion turns a
`negative` companion into the diffusion stage's unconditional branch).

A failure of the request or of any companion ends all of them (the request fails); an abort aborts
all of them in the engine.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from .engines import BadInput, Engine, EngineRequest

ROLE = re.compile(r"^[a-z0-9_]{1,32}$")
MAX_COMPANIONS = 8
QUEUE_CHUNKS = 16  # chunks of a request and its companions made but not yet sent on
_END = object()


@dataclass(frozen=True)
class Companion:
    role: str
    input: Any
    sampling_params: dict[str, Any]


def expand(fn: Callable, item: Any, request: EngineRequest) -> list[Companion]:
    """The companions fn makes for one input item, checked."""
    try:
        made = fn(item, dict(request.sampling_params), request.info)
    except BadInput:
        raise
    except Exception as e:
        raise RuntimeError(f"prompt expansion failed: {type(e).__name__}: {e}") from None
    if made is None:
        return []
    if not isinstance(made, (list, tuple)) or len(made) > MAX_COMPANIONS:
        raise RuntimeError(f"prompt expansion must return a list of at most {MAX_COMPANIONS} companions, "
                           f"got {type(made).__name__}")
    out: list[Companion] = []
    for i, c in enumerate(made):
        role = c.get("role") if isinstance(c, dict) else None
        if not isinstance(role, str) or not ROLE.match(role) or any(o.role == role for o in out):
            raise RuntimeError(f"prompt expansion: companion {i} needs a unique role matching {ROLE.pattern}, "
                               f"got {role!r}")
        params = c.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RuntimeError(f"prompt expansion: companion {role!r}: sampling_params must be a dict")
        out.append(Companion(role, c.get("input"), {**request.sampling_params, **params}))
    return out


async def run(engine: Engine, fn: Callable, request: EngineRequest) -> AsyncIterator[tuple[str, Any]]:
    """(role, chunk) of the request ("") and of its companions, as the engine makes them."""
    items = [item async for item in request.inputs]  # whole input: at most one item
    companions = expand(fn, items[0], request) if items else []
    own = EngineRequest(request.request_id, _items(items), request.sampling_params, request.info)
    if not companions:
        async for out in engine.generate(own):
            yield "", out
        return
    runs = [("", own)] + [
        (c.role, EngineRequest(f"{request.request_id}__{c.role}", _items([c.input]), c.sampling_params, request.info))
        for c in companions]
    # Chunks made but not yet sent on are bounded: an engine faster than the stage's sending waits, as it
    # does without companions (where the stage pulls each chunk from the engine itself). Ends and errors
    # never wait for room.
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(QUEUE_CHUNKS)
    finished: set[str] = set()

    async def drive(role: str, req: EngineRequest) -> None:
        try:
            async for out in engine.generate(req):
                await room.acquire()
                queue.put_nowait((role, out))
            finished.add(req.request_id)
            queue.put_nowait((role, _END))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which ends every run
            queue.put_nowait((role, e))

    tasks = [asyncio.create_task(drive(role, req)) for role, req in runs]
    try:
        left = len(tasks)
        while left:
            role, out = await queue.get()
            if out is _END:
                left -= 1
            elif isinstance(out, BadInput) and role:
                raise BadInput(f"the {role!r} companion: {out}") from out
            elif isinstance(out, asyncio.CancelledError):
                raise RuntimeError(f"the {role or 'request'} run was cancelled")
            elif isinstance(out, BaseException):
                raise out
            else:
                room.release()
                yield role, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, req in runs:  # the engine frees whatever an unfinished run holds
            if req.request_id not in finished and engine.dead() is None:
                await engine.abort(req.request_id)


async def _items(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
