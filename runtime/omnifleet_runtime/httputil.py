"""What the master's two HTTP servers share: error bodies, bearer-token checks, JSON forms of payloads,
and a port that closes without cutting off a connection it took."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import hmac
import json
import logging
import select
import socket
import struct
import sys
import time
from typing import Any

from aiohttp import web

from . import wire


def error_response(status: int, message: str, code: str, headers: dict[str, str] | None = None,
                   **extra: Any) -> web.Response:
    body = {"error": {"message": message, "type": code, "code": status, **extra}}
    return web.json_response(body, status=status, headers=headers)


def bearer_ok(request: web.Request, secret: str) -> bool:
    """Whether the request carries `Authorization: Bearer <secret>` (compared in constant time)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), secret.encode())


log = logging.getLogger("omnifleet.http")

BACKLOG = 128  # aiohttp's own default
SO_ATTACH_FILTER = 26  # Linux, <asm-generic/socket.h>; Python's socket module does not name it


def drop_every_packet(sock: socket.socket) -> bool:
    """Attach a classic BPF program that drops every packet (Linux). On a listener no new handshake
    completes (a client's SYN goes unanswered; retried after the port closed, it is refused), while the
    connections already queued keep working: a child copies its listener's filter only when made."""
    if not sys.platform.startswith("linux"):
        return False
    insn = ctypes.create_string_buffer(struct.pack("=HBBI", 0x06, 0, 0, 0), 8)  # BPF_RET | BPF_K, 0: drop
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("@HP", 1, ctypes.addressof(insn)))
    except OSError as e:
        log.debug("no socket filter (%s): the port closes at once", e)
        return False
    return True


class GentleSite:
    """An HTTP port that closes without cutting off a connection it accepted. aiohttp's shutdown closes the
    listener, then reads nothing more: a client that connected just before (its request still on the way)
    is closed unanswered after the shutdown timeout, and what the kernel queued but the loop had not
    accepted is reset. Here no new connection completes first, what is queued is accepted, the port
    closes, and every connection taken gets up to grace_s to send its request and read the answer."""

    def __init__(self, runner: web.AppRunner, host: str, port: int):
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.runner = runner
        self.site = web.SockSite(runner, self.sock)

    async def start(self) -> None:
        await self.site.start()

    async def close(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        if drop_every_packet(self.sock):
            while select.select([self.sock], [], [], 0)[0] and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # the loop accepts what the kernel queued
        await self.site.stop()
        server = self.runner.server
        while server is not None and server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # answers while draining close their connections
        if server is not None and server.connections:
            log.info("%d connection(s) still open %gs after the port closed (idle keep-alive, or no request "
                     "sent): closing them", len(server.connections), grace_s)


def unauthorized(what: str) -> web.Response:
    return error_response(401, f"{what}: send 'Authorization: Bearer <key>'", "unauthorized",
                          headers={"WWW-Authenticate": "Bearer"})


def jsonable(value: Any) -> Any:
    """A JSON form of a payload value: bytes as base64, arrays as {dtype, shape, data}."""

    def leaf(v: Any) -> Any:
        if isinstance(v, (bytes, bytearray, memoryview)):
            return base64.b64encode(v).decode()
        if isinstance(v, wire.Array):
            return {"dtype": v.dtype, "shape": list(v.shape), "data": base64.b64encode(v.data).decode()}
        if v is None or isinstance(v, (str, int, float, bool)):
            return v
        return str(v)

    return wire.walk(value, leaf)


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):  # an llm stage's chunk
        return value["text"]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    return json.dumps(jsonable(value))
