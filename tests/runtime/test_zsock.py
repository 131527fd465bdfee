"""The runtime's asyncio driving of plain ZMQ sockets (zsock), over real TCP sockets on loopback: no
message lost or reordered when sends and receives on one socket interleave (the case where a ZMQ_FD
signal is consumed by the other side), blocking sends keep their order behind a full queue, a waiter
never hangs or piles up, and an oversized message is dropped whole without losing the next one."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from omnifleet_runtime import zsock


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def pair(ctx: zmq.Context, a: int, b: int, hwm: int = 1000) -> tuple[zsock.Socket, zsock.Socket]:
    server = zsock.Socket(ctx, a)
    server.linger = 0
    server.rcvhwm = server.sndhwm = hwm
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = zsock.Socket(ctx, b)
    client.linger = 0
    client.rcvhwm = client.sndhwm = hwm
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


async def test_interleaved_send_and_receive_on_one_socket_lose_nothing(ctx):
    """Both ends send and receive at once: each end's sends can eat the signal its waiting receiver needs."""
    router, dealer = pair(ctx, zmq.ROUTER, zmq.DEALER)
    n = 3000

    async def echo() -> None:
        for _ in range(n):
            ident, body = await router.recv_message(4)
            router.send_nowait([ident, body])

    async def produce() -> None:
        for i in range(n):
            await dealer.send([str(i).encode()])
            if i % 7 == 0:
                await asyncio.sleep(0)  # sometimes the receiver sleeps in between, sometimes not

    async def consume() -> list[int]:
        return [int((await dealer.recv_message(4))[0].bytes) for _ in range(n)]

    got = await asyncio.wait_for(asyncio.gather(echo(), produce(), consume()), 30)
    assert got[2] == list(range(n))
    router.close()
    dealer.close()


async def test_a_message_from_another_thread_wakes_the_waiting_receiver(ctx):
    pull = zsock.Socket(ctx, zmq.PULL)
    pull.linger = 0
    port = pull.bind_to_random_port("tcp://127.0.0.1")

    def later() -> None:
        push = ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.connect(f"tcp://127.0.0.1:{port}")
        for i in range(50):
            time.sleep(0.01)
            push.send_multipart([b"m", str(i).encode()])
        push.close()

    t = threading.Thread(target=later)
    t.start()
    got = [int((await asyncio.wait_for(pull.recv_message(4), 10))[1].bytes) for _ in range(50)]
    t.join()
    assert got == list(range(50))
    pull.close()


async def test_blocking_sends_wait_for_room_and_keep_their_order(ctx):
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH, hwm=1)
    big = b"x" * (1 << 20)  # fills the kernel buffers too, so the queue really is full
    senders = [asyncio.create_task(push.send([str(i).encode(), big])) for i in range(40)]
    await asyncio.sleep(0.3)
    assert not all(s.done() for s in senders), "the receiver reads nothing yet: some sends must wait"
    with pytest.raises(zmq.Again):
        push.send_nowait([b"late", b""])  # never jumps the queue of waiting sends
    got = [int((await asyncio.wait_for(pull.recv_message(4), 10))[0].bytes) for _ in range(40)]
    assert got == list(range(40))
    await asyncio.wait_for(asyncio.gather(*senders), 10)
    pull.close()
    push.close()


async def test_waiting_with_timeouts_leaves_no_waiter_behind(ctx):
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
    other = zsock.Socket(ctx, zmq.PULL)
    for _ in range(200):
        assert await zsock.readable([pull, other], 0.0005) == []
        assert not await pull.poll(0.5)
    assert not pull._waiters and not other._waiters
    await push.send([b"hi"])
    assert await zsock.readable([pull, other], 5) == [pull]
    assert [f.bytes for f in await pull.recv_message(4)] == [b"hi"]
    for s in (pull, push, other):
        s.close()


async def test_an_oversized_message_is_dropped_whole_and_the_next_one_arrives(ctx):
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
    await push.send([b"a"] * 10)
    await push.send([b"b" * 100, b"c" * 100])
    await push.send([b"ok", b"fine"])
    with pytest.raises(zsock.Oversized):
        await asyncio.wait_for(pull.recv_message(4), 5)
    with pytest.raises(zsock.Oversized):
        await asyncio.wait_for(pull.recv_message(4, max_bytes=150), 5)
    assert [f.bytes for f in await asyncio.wait_for(pull.recv_message(4, max_bytes=150), 5)] == [b"ok", b"fine"]
    pull.close()
    push.close()


async def test_closing_wakes_a_waiting_receiver_with_an_error(ctx):
    pull, push = pair(ctx, zmq.PULL, zmq.PUSH)
    waiting = asyncio.create_task(pull.recv_message(4))
    await asyncio.sleep(0.05)
    pull.close()
    with pytest.raises(zmq.ZMQError):
        await asyncio.wait_for(waiting, 5)
    push.close()


@pytest.mark.parametrize("probe", ["events", "recheck"])
async def test_a_look_at_the_socket_does_not_strand_its_waiting_receiver(ctx, probe):
    """Reading ZMQ_EVENTS (as the master does while a connection closes) or sending through a shadow of the
    plain socket (its reachability probes) can take the FD signal a waiting receiver needs: the receiver
    must still be woken."""
    router, dealer = pair(ctx, zmq.ROUTER, zmq.DEALER)
    try:
        await _look_and_receive(router, dealer, probe)
    finally:  # a stranded receiver must fail the test, not hang the context's term
        router.close()
        dealer.close()


async def _look_and_receive(router: zsock.Socket, dealer: zsock.Socket, probe: str) -> None:
    dealer.send_nowait([b"hello"])
    await asyncio.wait_for(router.recv_message(4), 10)  # the DEALER is known to the ROUTER
    for i in range(20):
        waiting = asyncio.ensure_future(router.recv_message(4))
        await asyncio.sleep(0)  # it found nothing and sleeps on the socket's signal
        assert not waiting.done()
        dealer.sock.send(str(i).encode())
        deadline = time.monotonic() + 10
        if probe == "events":
            # The look takes the signal; no loop turn happens in between.
            while not router.events() & zsock.POLLIN and time.monotonic() < deadline:
                time.sleep(0.001)
        else:
            shadow = zmq.Socket.shadow(router.sock.underlying)
            while not shadow.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() < deadline:
                time.sleep(0.001)
            router.recheck()
        _, body = await asyncio.wait_for(waiting, 5)
        assert body.bytes == str(i).encode()
