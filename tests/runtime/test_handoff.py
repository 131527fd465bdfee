"""The engines' worker threads (handoff.Threads): real threads, real event loop."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
from omnifleet_runtime.handoff import Threads

REQUEST = contextvars.ContextVar("request", default="")


async def test_results_exceptions_and_the_callers_context_come_back():
    threads = Threads("t")
    REQUEST.set("r1")
    assert await threads.run(lambda a, b: (a + b, REQUEST.get(), threading.current_thread().name), 2, 3) \
        == (5, "r1", "t_1")
    with pytest.raises(ZeroDivisionError):
        await threads.run(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="StopIteration"):  # a Future cannot carry it
        await threads.run(next, iter(()))
    assert await threads.run(next, iter(()), "end") == "end"
    threads.close()


async def test_one_thread_serves_calls_in_turn_and_more_start_only_while_all_are_busy():
    threads = Threads("t", max_threads=3)
    for i in range(20):
        assert await threads.run(lambda x: x * 2, i) == 2 * i
    assert threads._started == 1
    gate, inside = threading.Event(), []

    def held(i):
        inside.append(i)
        gate.wait(10)
        return i

    calls = [asyncio.ensure_future(threads.run(held, i)) for i in range(5)]
    for _ in range(200):  # three run at once (the ceiling); the other two wait for a free thread
        if len(inside) == 3:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert sorted(inside) == [0, 1, 2] and threads._started == 3
    assert threads._free == -2  # the two queued calls: each is owed the next thread free
    gate.set()
    assert await asyncio.gather(*calls) == [0, 1, 2, 3, 4]
    for _ in range(200):  # each thread idle again, counted once: the two queued calls were nobody's idle thread
        if threads._free >= 3:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert threads._free == 3
    threads.close()


async def test_a_cancelled_caller_lets_the_call_finish_and_the_thread_serve_the_next():
    threads = Threads("t", max_threads=1)
    gate, finished = threading.Event(), threading.Event()

    def slow():
        gate.wait(10)
        finished.set()
        return "late"

    call = asyncio.ensure_future(threads.run(slow))
    await asyncio.sleep(0.01)
    call.cancel()
    gate.set()
    assert await threads.run(lambda: "next") == "next"
    assert finished.is_set() and call.cancelled()
    threads.close()


async def test_closed_threads_refuse_calls_and_end():
    threads = Threads("t")
    assert await threads.run(lambda: 1) == 1
    started = [t for t in threading.enumerate() if t.name.startswith("t_")]
    threads.close()
    with pytest.raises(RuntimeError, match="shut down"):
        threads.run(lambda: 2)
    for t in started:
        t.join(5)
        assert not t.is_alive()
