"""ZMQ sockets on the asyncio loop, without zmq.asyncio's futures.

zmq.asyncio pays for a Future, a flag enum round and a loop callback on every
send and every frame received; at the runtime's message rates that was a
fifth to a quarter of each process's CPU. Here a plain socket's ZMQ_FD is
watched once for the socket's life, sends and receives are tried at once
(non-blocking) and only a caller that finds nothing to read (or no room to
write) waits, on one Future.

ZMQ_FD is not the socket's readiness: it signals that ZMQ_EVENTS should be
read again, and reading ZMQ_EVENTS, or any send or receive, can consume that
signal. So the reader callback always reads EVENTS (else the loop, which polls
level-triggered, would spin on the signal); every read of EVENTS (`events()`)
wakes whoever waits for what it shows, since the signal that would have woken
them may be the one it took; and after a send or receive (or a use of the
plain socket, `recheck()`), EVENTS is read again on the next loop turn.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

EVENTS, POLLIN, POLLOUT, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)


class Socket:
    """One zmq socket owned by one event loop (create it on that loop; only that loop's thread uses it)."""

    __slots__ = ("sock", "_loop", "_fd", "_waiters", "_senders", "_send_lock", "_check_soon", "closed")

    def __init__(self, ctx: zmq.Context, kind: int):
        self.sock = zmq.Socket(ctx, kind)
        self._init()

    @classmethod
    def wrap(cls, sock: zmq.Socket) -> Socket:
        """Own an existing plain socket (a monitor socket, say)."""
        self = cls.__new__(cls)
        self.sock = sock
        self._init()
        return self

    def _init(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = self.sock.FD
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._senders = 0  # blocking sends waiting for room (later ones queue behind them: order is kept)
        self._send_lock: asyncio.Lock | None = None
        self._check_soon = False
        self.closed = False
        self._loop.add_reader(self._fd, self._on_fd)

    # ------------------------------------------------------------ readiness

    def events(self) -> int:
        """ZMQ_EVENTS now. Whoever waits for what it shows is woken: reading it may take the FD signal
        that would have woken them."""
        events = self.sock.get(EVENTS)
        if self._waiters:
            keep: deque[tuple[int, asyncio.Future]] = deque()
            for want, fut in self._waiters:
                if fut.done():
                    continue
                if events & want:
                    fut.set_result(None)
                else:
                    keep.append((want, fut))
            self._waiters = keep
        return events

    def _on_fd(self) -> None:
        self._check_soon = False
        if not self.closed:
            self.events()  # read even with no waiter: it clears the signal

    def recheck(self) -> None:
        """After a send or receive, or any use of the plain socket (a shadow's): whoever waits gets EVENTS
        read again on the next loop turn (the signal may be gone)."""
        if self._waiters and not self._check_soon:
            self._check_soon = True
            self._loop.call_soon(self._on_fd)

    async def _wait(self, want: int, timeout_s: float | None = None) -> bool:
        if self.events() & want:
            return True
        entry = (want, self._loop.create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(entry[1], timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            _forget(self, entry)

    async def poll(self, timeout_ms: float | None = None, flags: int = POLLIN) -> bool:
        """Whether the socket is ready (for flags) within timeout_ms (None: wait for ever; 0: now)."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        if timeout_ms is not None and timeout_ms <= 0:
            return bool(self.events() & flags)
        return await self._wait(flags, None if timeout_ms is None else timeout_ms / 1000)

    # ------------------------------------------------------------ receiving

    def recv_nowait(self, max_frames: int, max_bytes: int | None = None) -> list | None:
        """One whole message as zero-copy frames, or None when none is queued. Past max_frames frames (or
        max_bytes in all) the rest of it is read and let go at once and Oversized is raised."""
        try:
            first = self.sock.recv(NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self.recheck()
        if not first.more:
            return [first]
        # The rest of a multipart message is already here: ZMQ delivers messages whole.
        frames, total, over, more = [first], len(first), False, True
        while more:
            frame = self.sock.recv(NOBLOCK, copy=False)
            more = frame.more
            total += len(frame)
            if over or len(frames) >= max_frames or (max_bytes is not None and total > max_bytes):
                over = True
                continue
            frames.append(frame)
        if over:
            raise Oversized(f"a message of more than {max_frames} frames"
                            + (f" or {max_bytes} bytes" if max_bytes is not None else "") + " was dropped")
        return frames

    async def recv_message(self, max_frames: int, max_bytes: int | None = None) -> list:
        """The next whole message (see recv_nowait)."""
        while True:
            frames = self.recv_nowait(max_frames, max_bytes)
            if frames is not None:
                return frames
            await self._wait(POLLIN)

    # ------------------------------------------------------------ sending

    def send_nowait(self, frames: list[Any], copy: bool = False) -> None:
        """Queue a message now or raise zmq.Again (no room, or blocking sends are waiting before it)."""
        if self._senders:
            raise zmq.Again()
        self.sock.send_multipart(frames, NOBLOCK, copy=copy)
        self.recheck()

    async def send(self, frames: list[Any], copy: bool = False) -> None:
        """Queue a message, waiting for room (messages leave in the order of the calls)."""
        if not self._senders:
            try:
                self.sock.send_multipart(frames, NOBLOCK, copy=copy)
                self.recheck()
                return
            except zmq.Again:
                pass
        self._senders += 1
        try:
            if self._send_lock is None:
                self._send_lock = asyncio.Lock()
            async with self._send_lock:  # first come, first sent
                while True:
                    await self._wait(POLLOUT)
                    try:
                        # A message is queued whole or not at all: a first frame taken means room for the rest.
                        self.sock.send_multipart(frames, NOBLOCK, copy=copy)
                        break
                    except zmq.Again:
                        continue
        finally:
            self._senders -= 1
        self.recheck()

    # ------------------------------------------------------------ lifetime

    def close(self, linger: int | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(zmq.ZMQError(zmq.ENOTSOCK))
        self._waiters.clear()
        self.sock.close(linger=linger)

    def __getattr__(self, name: str) -> Any:  # options, bind, connect, monitor, ... of the plain socket
        return getattr(self.sock, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in Socket.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.sock, name, value)


async def readable(socks: list[Socket], timeout_s: float) -> list[Socket]:
    """The sockets with a message to read, waiting up to timeout_s for one (an empty list: none came)."""
    ready = [s for s in socks if s.events() & POLLIN]
    if ready or timeout_s <= 0:
        return ready
    entry = (POLLIN, asyncio.get_running_loop().create_future())
    for s in socks:
        s._waiters.append(entry)
    try:
        await asyncio.wait_for(entry[1], timeout_s)
    except asyncio.TimeoutError:
        return []
    finally:
        for s in socks:
            _forget(s, entry)
    return [s for s in socks if s.events() & POLLIN]


def _forget(sock: Socket, entry: tuple[int, asyncio.Future]) -> None:
    """A waiter that timed out or was cancelled leaves the socket's list at once (a quiet socket's
    reader callback, which also drops them, may not run for hours)."""
    if entry in sock._waiters:  # a miss in remove() would build its message from the Future's repr
        sock._waiters.remove(entry)


class Oversized(Exception):
    """A message over the frame count or byte total; it was read and dropped."""


MONITOR_FRAMES = 2  # a monitor event: [event id and value][endpoint]


def monitor_event(frames: list) -> dict:
    return parse_monitor_message([f.bytes for f in frames])
