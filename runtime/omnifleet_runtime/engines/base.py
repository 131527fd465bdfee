"""The engine interface every stage engine implements, and callable references.

A stage process owns one engine. The stage feeds it one EngineRequest per
request and sends whatever generate() yields downstream, chunk by chunk. New
engine kinds (vLLM, diffusion) implement this class; neither the master nor
the stage loop changes for them.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from ..wire import RequestInfo


@dataclass
class EngineRequest:
    request_id: str
    # The stage's inputs, as its input processor made them: one item in
    # `whole` mode, one item per upstream chunk in `stream` mode.
    inputs: AsyncIterator[Any]
    sampling_params: dict[str, Any]
    info: RequestInfo
    # Whether every input is already here (no item remains to come after the one in hand).
    inputs_ended: Callable[[], bool] = lambda: False
    # Set by an engine just before it yields its last chunk (it yields nothing after): the stage marks that
    # chunk as its end, so downstream gets no end message of its own.
    last: bool = False


def requested_voice(info: Any) -> Any:
    """The voice a request asks for as the client sent it (chat's and a completion's `audio.voice`, speech's
    `voice`), or None; each engine checks it against its model's voices."""
    extra = getattr(info, "extra", None) or {}
    audio = extra.get("audio")
    return (audio.get("voice") if isinstance(audio, dict) else None) or extra.get("voice")


class BadInput(ValueError):
    """The request itself is wrong (an input or a parameter the engine cannot take): the client gets 400
    with this message, not a 500. Engines, input processors and python stages raise it for that."""


class EngineStartError(RuntimeError):
    """The stage's engine cannot start (bad engine arg, missing model, ...); the message says why,
    naming the stage. The stage logs it as one line and exits non-zero."""


class Engine(abc.ABC):
    # Requests the stage lets into generate() at once; None means no limit
    # (engines that batch, like vLLM, queue internally).
    max_concurrency: int | None = None
    # The stage's metrics.StageMetrics, set before start(); engines with series of their own record there.
    metrics: Any = None

    async def start(self) -> None:
        """Load weights and warm up; called once before the stage registers."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Output chunks for one request. Cancelling the iteration aborts the request."""

    def dead(self) -> str | None:
        """Why the loaded engine can serve no more (its engine process died, ...), or None while it can.
        Polled by the stage; cheap and non-blocking."""
        return None

    async def abort(self, request_id: str) -> None:
        """Free what the request holds (called after its generate() was cancelled)."""

    async def control(self, method: str, args: dict[str, Any]) -> Any:
        """A control RPC (sleep/wake, profiling, ...); raise for an unsupported method."""
        raise ValueError(f"unsupported control method {method!r}")

    async def export(self, value: Any, cuda_ipc: bool) -> Any:
        """An output chunk as one route takes it: engines whose outputs hold device memory (CUDA tensors)
        give a co-located route that takes them (cuda_ipc) IPC handles, every other route host copies.
        Called once for the IPC routes and once for all others; the default: the value as it is."""
        return value

    def for_master(self, value: Any) -> Any:
        """What the master gets of a final output chunk (the routes get all of it): the default, all; None: the
        chunk is for the routes only (a vllm-omni stage's connector chunks, which no client reads)."""
        return value

    def host_buffers(self) -> Callable[[int], Any] | None:
        """A maker of n-byte writable buffers for the large inputs this stage reassembles, when the engine has
        one that suits it better than ordinary memory (the torch engine on a GPU: pinned host memory, which
        its copy to the device reads at full speed); None: ordinary memory."""
        return None

    def release(self, value: Any) -> None:
        """Let go of what a payload that will never be read holds beyond its bytes (the producer's
        CUDA memory behind an IPC handle). Cheap; never raises."""

    async def shutdown(self) -> None:
        """Release the engine; called once on exit."""


def load_callable(ref: str) -> Any:
    """The object named by `package.module:attr.path`."""
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
