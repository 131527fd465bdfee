"""The master's API port closes without cutting off a connection it took (httputil.GentleSite).

A Service may route a connection to a master in the very moment its drain ends. aiohttp's own shutdown
closes such a connection unanswered once its request arrives after the shutdown began (the chaos test on
real pods lost one so, 2 s after it was sent); a connection the kernel queued but the loop had not yet
accepted would be reset. These tests use real sockets on loopback and the real kernel filter.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import select
import socket
import time

from aiohttp import web

from omnifleet_runtime.httputil import GentleSite, drop_every_packet

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def test_a_filtered_listener_completes_no_new_handshake_but_serves_what_it_queued():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    queued = socket.create_connection(("127.0.0.1", port), timeout=10)  # handshake done, not accepted yet
    queued.sendall(b"ping")
    assert drop_every_packet(srv)
    late = socket.socket()
    late.setblocking(False)
    assert late.connect_ex(("127.0.0.1", port)) == errno.EINPROGRESS  # its SYN goes unanswered
    assert select.select([], [late], [], 0.3)[1] == []  # not connected while the filter holds
    conn, _ = srv.accept()  # what was queued before the filter is still there, and works
    assert conn.recv(4) == b"ping"
    conn.sendall(b"pong")
    assert queued.recv(4) == b"pong"
    assert not select.select([srv], [], [], 0)[0]  # nothing else was queued
    srv.close()
    _, writable, _ = select.select([], [late], [], 10)  # the retried SYN finds the port closed
    assert writable and late.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED  # never accepted
    for s in (late, queued, conn):
        s.close()


async def test_a_connection_taken_before_the_port_closed_is_answered_after_it():
    async def draining(request: web.Request) -> web.Response:
        resp = web.json_response({"error": {"message": "shutting down"}}, status=503)
        resp.force_close()
        return resp

    app = web.Application()
    app.add_routes([web.post("/v1/completions", draining)])
    runner = web.AppRunner(app, shutdown_timeout=2.0)
    await runner.setup()
    site = GentleSite(runner, "127.0.0.1", 0)
    port = site.sock.getsockname()[1]
    await site.start()
    loop = asyncio.get_running_loop()
    client = socket.create_connection(("127.0.0.1", port), timeout=10)  # connected; its request not yet sent
    try:
        deadline = time.monotonic() + 10
        while not runner.server.connections:  # accepted by the server
            assert time.monotonic() < deadline, "the connection was never accepted"
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(site.close(grace_s=30))
        while site.sock.fileno() != -1:  # the port is closed ...
            assert not closing.done() and time.monotonic() < deadline
            await asyncio.sleep(0.01)
        refused = await loop.run_in_executor(None, connect_error, port)
        assert refused == "ConnectionRefusedError", refused  # ... a new connection is refused, never taken
        await loop.run_in_executor(None, client.sendall, REQUEST)  # ... and the request sent only now
        raw = await loop.run_in_executor(None, read_all, client)
        assert raw.startswith(b"HTTP/1.1 503 ") and b"shutting down" in raw, raw  # is answered
        await asyncio.wait_for(closing, 10)  # and the close ends once that connection did, not at its grace
    finally:
        client.close()
        await runner.cleanup()


def connect_error(port: int) -> str:
    try:
        http.client.HTTPConnection("127.0.0.1", port, timeout=10).connect()
    except OSError as e:
        return type(e).__name__
    return "connected"


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)
