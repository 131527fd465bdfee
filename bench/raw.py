"""The limits the benchmarks compare against: plain Python peers on loopback, one process each end.

`python -m bench.raw SERVER PORT [ARGS]` runs one server (it prints "ready" once
bound and exits when its client says so or its stdin closes); the client
functions run in the benchmark process.

- zmq-echo: ROUTER echoing each message (the DEALER->ROUTER->DEALER round trip).
  Mode `sync` (blocking pyzmq, the limit), `async` (zmq.asyncio on both ends, the
  way the runtime did it before zsock), or `reader` (asyncio on both ends through
  the runtime's own zsock: plain sockets driven by loop.add_reader(socket.FD)).
- tcp-sink: receives [16-byte header: size, t0][size bytes] with recv_into into
  one reused buffer, touches a byte of every page, answers t1 - t0 (one way).
- zmq-sink: the same over ZMQ PUSH -> PULL, one frame or several per message,
  received zero-copy; answers over a second PUSH -> PULL pair.

`wake_cost` (a process of its own, no server) is a control for CPU per request: the same
piece of Python work right after the last one, and after sleeping a while.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq
import zmq.asyncio

from omnifleet_runtime import zsock

from .fns import touch

ROOT = Path(__file__).resolve().parents[1]
HDR = struct.Struct("<Qd")
ACK = struct.Struct("<d")
STOP_SIZE = (1 << 64) - 1


def _watch_stdin() -> None:
    """Exit when the parent goes away (its end of our stdin closes)."""

    def watch():
        try:
            sys.stdin.buffer.read()
        finally:
            os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------- servers


def zmq_echo(port: int, mode: str = "sync") -> None:
    if mode == "async":

        async def serve():
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.bind(f"tcp://127.0.0.1:{port}")
            print("ready", flush=True)
            while True:
                frames = await sock.recv_multipart(copy=False)
                await sock.send_multipart(frames, copy=False)

        asyncio.run(serve())
        return
    if mode == "reader":

        async def serve_reader():
            sock = zsock.Socket(zmq.Context(), zmq.ROUTER)
            sock.linger = 0
            sock.bind(f"tcp://127.0.0.1:{port}")
            print("ready", flush=True)
            while True:
                sock.send_nowait(await sock.recv_message(8))

        asyncio.run(serve_reader())
        return
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def tcp_sink(port: int, max_size: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(b"\x01" * max_size)  # one reused, resident buffer: the best a receiver can do
    view = memoryview(buf)
    hdr = bytearray(HDR.size)
    while True:
        _recv_exact(conn, memoryview(hdr))
        size, t0 = HDR.unpack(hdr)
        if size == STOP_SIZE:
            return
        _recv_exact(conn, view[:size])
        touch([view[:size]])
        conn.sendall(ACK.pack(time.monotonic() - t0))


def zmq_sink(port: int, ack_port: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(f"tcp://127.0.0.1:{port}")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.bind(f"tcp://127.0.0.1:{ack_port}")
    print("ready", flush=True)
    while True:
        frames = pull.recv_multipart(copy=False)
        (t0,) = ACK.unpack(frames[0].bytes)
        if t0 < 0:
            return
        touch([f.buffer for f in frames[1:]])
        push.send(ACK.pack(time.monotonic() - t0))


# ---------------------------------------------------------------- client side


class Server:
    """A raw server subprocess; bounded start, killed on close."""

    def __init__(self, *args: str, timeout: float = 20.0):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.raw", *args], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"raw server {args} did not start")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def zmq_rtt(port: int, size: int, n: int, warmup: int, time_limit_s: float, mode: str = "sync") -> list[float]:
    """Round trips of a `size`-byte message, DEALER -> ROUTER (echo) -> DEALER; seconds each."""
    payload = b"\x5a" * size
    if mode == "reader":

        async def run_reader() -> list[float]:
            ctx = zmq.Context()
            sock = zsock.Socket(ctx, zmq.DEALER)
            sock.linger = 0
            sock.connect(f"tcp://127.0.0.1:{port}")
            out: list[float] = []
            deadline = time.monotonic() + time_limit_s
            for i in range(n + warmup):
                if time.monotonic() > deadline:
                    break
                t0 = time.perf_counter()
                await sock.send([payload])
                await asyncio.wait_for(sock.recv_message(8), 10)
                if i >= warmup:
                    out.append(time.perf_counter() - t0)
            sock.close()
            ctx.term()
            return out

        return asyncio.run(run_reader())
    if mode == "async":

        async def run() -> list[float]:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(f"tcp://127.0.0.1:{port}")
            out: list[float] = []
            deadline = time.monotonic() + time_limit_s
            for i in range(n + warmup):
                if time.monotonic() > deadline:
                    break
                t0 = time.perf_counter()
                await sock.send(payload, copy=False)
                await sock.recv(copy=False)
                if i >= warmup:
                    out.append(time.perf_counter() - t0)
            sock.close()
            ctx.term()
            return out

        return asyncio.run(run())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 10_000
    sock.connect(f"tcp://127.0.0.1:{port}")
    out = []
    deadline = time.monotonic() + time_limit_s
    for i in range(n + warmup):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        sock.send(payload, copy=False)
        sock.recv(copy=False)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    sock.close()
    ctx.term()
    return out


class TcpClient:
    """Sends [header][bytes] to a tcp-sink and reads back its one-way time."""

    def __init__(self, port: int, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def one_way(self, buf) -> float:
        view = memoryview(buf)
        self.sock.sendall(HDR.pack(view.nbytes, time.monotonic()))
        self.sock.sendall(view)
        ack = bytearray(ACK.size)
        _recv_exact(self.sock, memoryview(ack))
        return ACK.unpack(ack)[0]

    def close(self) -> None:
        try:
            self.sock.sendall(HDR.pack(STOP_SIZE, 0.0))
        except OSError:
            pass
        self.sock.close()


class ZmqPushClient:
    """Sends [t0][frames...] over PUSH to a zmq-sink and reads back its one-way time."""

    def __init__(self, port: int, ack_port: int):
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.push.connect(f"tcp://127.0.0.1:{port}")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.pull.rcvtimeo = 60_000
        self.pull.connect(f"tcp://127.0.0.1:{ack_port}")

    def one_way(self, buf, chunk: int = 0) -> float:
        view = memoryview(buf)
        parts = [view] if not chunk else [view[i:i + chunk] for i in range(0, view.nbytes, chunk)]
        self.push.send_multipart([ACK.pack(time.monotonic()), *parts], copy=False)
        return ACK.unpack(self.pull.recv())[0]

    def close(self) -> None:
        self.push.send_multipart([ACK.pack(-1.0)])
        time.sleep(0.05)
        self.push.close()
        self.pull.close()
        self.ctx.term()


def _fixed_work() -> None:
    # JSON and dicts, as a request's handling is: a working set of interpreter code and objects.
    doc = {"a": list(range(200)), "b": "x" * 100, "c": {"d": [1.5] * 20}}
    for _ in range(60):
        json.loads(json.dumps(doc))


def _wake_cost_child(sleep_s: float, n: int) -> None:
    warm, cold = [], []
    _fixed_work()
    for _ in range(n):  # interleaved, so the machine's drift hits both alike
        for sleep, out in ((0.0, warm), (sleep_s, cold)):
            time.sleep(sleep)
            t0 = time.thread_time()
            _fixed_work()
            out.append(time.thread_time() - t0)
    print(json.dumps({"warm": warm, "cold": cold}))


def wake_cost(sleep_s: float, n: int = 20) -> dict[str, list[float]]:
    """CPU seconds of one fixed piece of Python work, run right after the previous one (`warm`) and after
    sleeping sleep_s (`cold`), n of each, in a fresh process: what a process pays to wake up on this machine
    (its caches and the CPU's state went to others meanwhile), whatever the process is."""
    code = f"from bench.raw import _wake_cost_child; _wake_cost_child({sleep_s!r}, {n})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=60 + 2 * n * sleep_s)
    return json.loads(out.stdout)


if __name__ == "__main__":
    _watch_stdin()
    kind, port, *rest = sys.argv[1:]
    if kind == "zmq-echo":
        zmq_echo(int(port), *rest)
    elif kind == "tcp-sink":
        tcp_sink(int(port), int(rest[0]))
    elif kind == "zmq-sink":
        zmq_sink(int(port), int(rest[0]))
    else:
        print(f"unknown server {kind!r}", file=sys.stderr)
        os._exit(2)
    sys.stdout.flush()
    os._exit(0)  # not a normal shutdown: the stdin watcher thread is blocked in a read
