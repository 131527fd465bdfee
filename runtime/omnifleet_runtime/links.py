"""A stage's connections to one downstream data port (see stripes.py for why there are several).

The first connection carries everything until the others are up. Each further
one is pinned to its own libzmq I/O thread and connected only once the
previous handshake is done: the receiver hands an accepted connection to its
least loaded I/O thread, and connections that arrive together would all land
on the same one.

A link of a `curve` pipeline to a stage that has a bulk port carries messages of
seal.SEAL_MIN_BYTES or more there instead, sealed with AES-GCM (seal.py): the
CurveZMQ connection carries each one's key and layout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import zmq

from . import seal, stripes, zsock

log = logging.getLogger("omnifleet.links")

HANDSHAKE_WAIT_S = 5.0  # a connection not up by then ends the growing; the ones up keep serving


class Link:
    def __init__(self, ctx: zmq.Context, addr: str, streams: int, secure: Callable[[zmq.Socket], None],
                 encrypted: bool = True, bulk: "Link | None" = None):
        self.ctx, self.addr, self.secure, self.bulk = ctx, addr, secure, bulk
        # Over one connection, pieces pay off only when encrypting; unencrypted, a whole frame needs no
        # reassembly copy.
        self.pieces_alone = encrypted
        self.piece = stripes.PIECE_MAX_ENCRYPTED if encrypted else stripes.PIECE_MAX
        self.io_threads = max(1, ctx.get(zmq.IO_THREADS))
        self.socks: list[zsock.Socket] = []
        first = self._socket(0)
        # the first handshake too must be done before the second connect
        self.monitor = self._monitor(first) if streams > 1 else None
        first.connect(addr)
        self.grow = None if self.monitor is None else asyncio.get_running_loop().create_task(
            self._grow(streams, first))
        self.socks.append(first)
        self.up = 1  # socks[:up] carry messages; the one after them may be handshaking

    def _socket(self, i: int) -> zsock.Socket:
        sock = zsock.Socket(self.ctx, zmq.PUSH)
        sock.linger = 0
        sock.setsockopt(zmq.AFFINITY, 1 << (i % self.io_threads))
        self.secure(sock)
        return sock

    def _monitor(self, sock: zsock.Socket) -> zsock.Socket:
        return zsock.Socket.wrap(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))

    async def _handshake(self, sock: zsock.Socket) -> bool:
        """Waits for sock's handshake on self.monitor, then ends that monitor."""
        monitor = self.monitor
        try:
            while True:
                event = zsock.monitor_event(await asyncio.wait_for(monitor.recv_message(zsock.MONITOR_FRAMES),
                                                                   HANDSHAKE_WAIT_S))
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return True
        except asyncio.TimeoutError:
            return False
        finally:
            if not sock.closed:  # else close() ended its monitor already
                sock.disable_monitor()
            monitor.close(linger=0)
            self.monitor = None

    async def _grow(self, streams: int, first: zsock.Socket) -> None:
        if not await self._handshake(first):
            log.warning("data link to %s: no handshake in %gs; one connection only", self.addr, HANDSHAKE_WAIT_S)
            return
        for i in range(1, streams):
            sock = self._socket(i)
            self.monitor = self._monitor(sock)
            sock.connect(self.addr)
            self.socks.append(sock)  # closed with the link even while handshaking
            if not await self._handshake(sock):
                self.socks.pop().close(linger=0)
                log.warning("data link to %s: connection %d not up in %gs; %d serve", self.addr, i,
                            HANDSHAKE_WAIT_S, self.up)
                return
            self.up = len(self.socks)

    async def send(self, frames: list[Any], nbytes: int) -> None:
        if self.bulk is not None and nbytes >= seal.SEAL_MIN_BYTES:
            return await self._send_sealed(frames, nbytes)
        if nbytes >= stripes.STRIPE_MIN_BYTES and (self.up > 1 or self.pieces_alone):
            for sock, part in zip(self.socks, stripes.split(frames, self.up, self.piece)):
                await sock.send(part)
        else:
            await self.socks[0].send(frames)

    async def _send_sealed(self, frames: list[Any], nbytes: int) -> None:
        """The Announce first, then each part as it is sealed: a few parts are sealed ahead, on the seal
        threads, while earlier ones travel."""
        msg = seal.Sealed(frames, nbytes)
        await self.socks[0].send(msg.announce)
        loop, threads = asyncio.get_running_loop(), seal.pool()
        parts, ahead = len(msg.pieces), seal.threads() + 1
        sealing = [loop.run_in_executor(threads, msg.seal, p, msg.buffers(p)) for p in range(min(ahead, parts))]
        bulk = self.bulk
        for p in range(parts):
            part = await sealing[p]
            if p + ahead < parts:
                sealing.append(loop.run_in_executor(threads, msg.seal, p + ahead, msg.buffers(p + ahead)))
            await bulk.socks[p % bulk.up].send(part)
            del part

    def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()
        if self.grow is not None:
            self.grow.cancel()
        # Now, not when the cancelled growing next runs (it may never run again): a monitor socket left
        # open blocks the context's term() for ever.
        if self.monitor is not None:
            self.monitor.close(linger=0)
        for sock in self.socks:
            sock.close(linger=0)
