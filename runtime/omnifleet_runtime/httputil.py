"""What the master's two HTTP servers share: error bodies, bearer-token checks, JSON forms of payloads."""

from __future__ import annotations

import base64
import hmac
import json
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
