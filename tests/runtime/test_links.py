"""A stage's data link to one downstream port (links.Link), over real sockets on loopback: closing it at
any point of its growing (several connections, one handshake after another) closes every socket it
opened, so the context's term() returns and the process can exit. A monitor socket left open made a
stage that had just started a link hang in term() until the pod was killed."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import zmq

from omnifleet_runtime import zsock
from omnifleet_runtime.links import Link

STREAMS = 3


def terminates(ctx: zmq.Context) -> bool:
    """Whether ctx.term() returns (it blocks for as long as any socket of ctx is open)."""
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(timeout=10)
    return not t.is_alive()


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("turns", [0, 1, 5], ids=["before-growing-runs", "waiting-first", "waiting-later"])
async def test_a_link_closed_while_it_cannot_connect_lets_the_context_end(turns):
    ctx = zmq.Context(io_threads=STREAMS)
    link = Link(ctx, f"tcp://127.0.0.1:{unused_port()}", STREAMS, lambda sock: None, encrypted=False)
    for _ in range(turns):
        await asyncio.sleep(0.01)
    assert link.grow is not None and not link.grow.done()  # still waiting for its first handshake
    link.close()
    assert terminates(ctx)
    await asyncio.sleep(0.01)  # the cancelled growing ends quietly on the closed sockets
    assert link.grow.cancelled()


@pytest.mark.parametrize("grown", [1, 2, STREAMS], ids=["one-up", "two-up", "all-up"])
async def test_a_link_closed_at_any_step_of_growing_lets_the_context_end(grown):
    ctx = zmq.Context(io_threads=STREAMS)
    server = zsock.Socket(ctx, zmq.PULL)
    server.linger = 0
    port = server.bind_to_random_port("tcp://127.0.0.1")
    link = Link(ctx, f"tcp://127.0.0.1:{port}", STREAMS, lambda sock: None, encrypted=False)
    for _ in range(500):
        if link.up >= grown:
            break
        await asyncio.sleep(0.01)
    assert link.up >= grown
    await link.send([b"x"], 1)  # it carries messages while it grows
    assert (await server.recv_message(1))[0].bytes == b"x"
    link.close()
    server.close(linger=0)
    assert terminates(ctx)
