"""Worker threads for an engine's blocking calls, handed off more cheaply than by `asyncio.to_thread`.

`to_thread` goes through the loop's default executor: a concurrent Future with its condition variable,
an asyncio Future chained to it and the executor's bookkeeping, about 100 us a call on two cores against
about 45 us for this (one put on a queue the threads wait on, one `call_soon_threadsafe` back). The
threads start on demand (an idle one takes the next call) up to `max_threads`, run each call in the
caller's context as `to_thread` does, and are daemons: a call still blocked when the process exits does
not hold it. A call whose caller was cancelled runs to its end; its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from typing import Any, Callable

MAX_THREADS = 32  # asyncio's default executor's ceiling


class Threads:
    def __init__(self, name: str, max_threads: int | None = None):
        self.name = name
        self.max_threads = max(1, max_threads or MAX_THREADS)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        # Threads waiting for a call that no queued call has claimed, less the calls queued while every thread
        # was busy at the ceiling (each taken by the next thread free).
        self._free = 0
        self._closed = False

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """fn(*args) in one of the threads; await the Future for its result or exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: its threads are shut down")
            if self._free > 0 or self._started >= self.max_threads:
                self._free -= 1
            else:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self.name}_{self._started}", daemon=True).start()
        self._queue.put((loop, fut, contextvars.copy_context(), fn, args))
        return fut

    def close(self) -> None:
        """No more calls; the threads end after those already queued."""
        with self._lock:
            self._closed = True
            started = self._started
        for _ in range(started):
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, fut, ctx, fn, args = item
            del item
            try:
                result, ok = ctx.run(fn, *args), True
            except BaseException as e:  # as to_thread: the caller gets it, whatever it is
                result, ok = e, False
            with self._lock:  # free before the caller hears back: the call it makes next finds this thread
                self._free += 1
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, result)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            del loop, fut, ctx, fn, args, result


def _settle(fut: asyncio.Future, ok: bool, result: Any) -> None:
    if fut.done():  # the caller was cancelled
        return
    if ok:
        fut.set_result(result)
    elif isinstance(result, StopIteration):  # a Future refuses it (it would end a generator instead)
        fut.set_exception(RuntimeError(f"the call raised StopIteration: {result}"))
    else:
        fut.set_exception(result)
