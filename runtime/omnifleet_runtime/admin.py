"""The master's admin HTTP API, on its own port: registered replicas and control RPCs to stages.

`GET /v1/stages` lists every replica (pod names, data addresses, load);
`POST /v1/stages/{stage}/control` `{"method", "args", "timeout"}` calls a
method on every replica of a stage and answers each one's result. Both can
hurt a pipeline (a replica's name is what registration trusts; control runs
engine methods and user hooks), so they are not on the port clients use: the
admin port is declared in the pod but left out of the master Service, and
every call wants `Authorization: Bearer <admin token>` (from
spec.master.adminTokenSecret; without a token configured every call is
refused). Control methods are an allow-list per engine kind, each with the
arguments it takes and their bounds; `timeout` is finite and capped.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from aiohttp import web

from . import constants as C
from .httputil import bearer_ok, error_response, jsonable, unauthorized
from .limits import BadRequest, json_size, parse_body
from .orchestrator import Orchestrator
from .schema import OmniPipeline

log = logging.getLogger("omnifleet.admin")

MAX_BODY_BYTES = 1024 * 1024
MAX_ARGS_CHARS = 64 * 1024  # a python stage's hook arguments, in all
MAX_DIRECT_PROMPTS = 256
HOOK_METHOD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


def _nothing(args: dict[str, Any], limit: int) -> None:
    if args:
        raise BadRequest(f"this method takes no arguments (got {', '.join(map(repr, sorted(args)))})")


def _only(**checks: Callable[[Any, int], None]) -> Callable[[dict[str, Any], int], None]:
    """A check of args that may hold only these keys, each checked by its function."""

    def check(args: dict[str, Any], limit: int) -> None:
        unknown = sorted(k for k in args if k not in checks)
        if unknown:
            raise BadRequest(f"unknown argument(s) {', '.join(map(repr, unknown))} (this method takes "
                             f"{', '.join(sorted(checks)) or 'none'})")
        for key, fn in checks.items():
            if args.get(key) is not None:
                fn(args[key], limit)

    return check


def _sleep_level(value: Any, limit: int) -> None:
    if value not in (1, 2) or isinstance(value, bool):
        raise BadRequest("'args.level' must be 1 or 2")


def _tags(value: Any, limit: int) -> None:
    if not isinstance(value, list) or len(value) > 8 or not all(isinstance(t, str) and len(t) < 64 for t in value):
        raise BadRequest("'args.tags' must be a list of at most 8 short strings")


def _prompts(value: Any, limit: int) -> None:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_DIRECT_PROMPTS:
        raise BadRequest(f"'args.prompts' must be a list of 1 to {MAX_DIRECT_PROMPTS} inputs")
    if json_size(value, "args.prompts") > limit:
        raise BadRequest(f"'args.prompts' hold more than {limit} characters (spec.master.limits.maxPromptChars)")


def _params(value: Any, limit: int) -> None:
    if not isinstance(value, dict) or json_size(value, "args.sampling_params") > MAX_ARGS_CHARS:
        raise BadRequest("'args.sampling_params' must be an object (of bounded size)")


def _lora(value: Any, limit: int) -> None:
    if not isinstance(value, str) or len(value) > 63:
        raise BadRequest("'args.lora' must be the name of one of the stage's LoRA adapters")


_NO_ARGS = _only()
CONTROL_METHODS: dict[str, dict[str, Callable[[dict[str, Any], int], None]]] = {
    "llm": {
        "ping": _NO_ARGS, "stats": _NO_ARGS, "generate": _only(prompts=_prompts, sampling_params=_params, lora=_lora),
        "sleep": _only(level=_sleep_level), "wake_up": _only(tags=_tags), "reset_prefix_cache": _NO_ARGS,
        "start_profile": _NO_ARGS, "stop_profile": _NO_ARGS, "is_sleeping": _NO_ARGS,
    },
    "diffusion": {"ping": _NO_ARGS, "stats": _NO_ARGS},
    "torch": {"ping": _NO_ARGS, "sleep": _NO_ARGS, "wake_up": _NO_ARGS, "empty_cache": _NO_ARGS},
    # python: `ping`, and any method the entrypoint module's omnifleet_control hook takes (its author's code).
}


class Admin:
    def __init__(self, doc: OmniPipeline, orch: Orchestrator, token: str | None,
                 control_timeout_s: float = C.CONTROL_TIMEOUT_S):
        self.spec = doc.spec
        self.orch = orch
        self.token = token or None
        self.control_timeout_s = control_timeout_s
        self.types = {s.name: s.type for s in doc.spec.stages}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.add_routes([
            web.get("/v1/stages", self.stages),
            web.post("/v1/stages/{stage}/control", self.control),
        ])
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.token is None:
            return error_response(403, "the admin API is off: no admin token is configured "
                                  "(spec.master.adminTokenSecret, or --admin-token-file)", "forbidden")
        if not bearer_ok(request, self.token):
            self.orch.metrics.refused.inc(reason="admin_unauthorized")
            return unauthorized("the admin API wants the admin token")
        return await handler(request)

    async def stages(self, request: web.Request) -> web.Response:
        out = {}
        for s in self.spec.stages:
            out[s.name] = [
                {"replica": r.replica, "data_addr": r.data_addr, "bulk_addr": r.bulk_addr, "inflight": r.outstanding,
                 "queue_depth": r.queue_depth, "draining": r.draining}
                for r in self.orch.membership.replicas(s.name)
            ]
        return web.json_response({"stages": out})

    def check(self, stage: str, body: dict[str, Any]) -> tuple[str, dict[str, Any], float]:
        """(method, args, timeout) of a control call, or BadRequest naming what is wrong."""
        unknown = sorted(k for k in body if k not in ("method", "args", "timeout"))
        if unknown:
            raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))} (method, args, timeout)")
        method, args = body.get("method"), body.get("args") or {}
        if not isinstance(method, str) or not method:
            raise BadRequest("'method' is required (a string)")
        if not isinstance(args, dict):
            raise BadRequest("'args' must be an object")
        timeout = body.get("timeout", self.control_timeout_s)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
                not 0 < timeout <= C.CONTROL_TIMEOUT_MAX_S:
            raise BadRequest(f"'timeout' must be a number of seconds above 0 and at most {C.CONTROL_TIMEOUT_MAX_S:g}")
        kind = self.types[stage]
        allowed = CONTROL_METHODS.get(kind)
        limit = self.spec.master.limits.max_prompt_chars
        if allowed is None:  # a python stage: its module's hook decides which methods exist
            if not HOOK_METHOD.match(method):
                raise BadRequest("'method' must be a name of at most 64 letters, digits, '_', '.' or '-'")
            if json_size(args, "args") > MAX_ARGS_CHARS:
                raise BadRequest(f"'args' hold more than {MAX_ARGS_CHARS} characters")
        elif method not in allowed:
            raise BadRequest(f"method {method[:64]!r} is not allowed on a {kind} stage "
                             f"(allowed: {', '.join(sorted(allowed))})")
        else:
            allowed[method](args, limit)
        return method, args, float(timeout)

    async def control(self, request: web.Request) -> web.Response:
        stage = request.match_info["stage"]
        if stage not in self.types:
            return error_response(404, f"no stage named {stage[:64]!r}", "not_found")
        try:
            method, args, timeout = self.check(stage, parse_body(await request.read()))
        except BadRequest as e:
            return error_response(400, f"bad control request: {e}", "invalid_request_error")
        log.info("control %s on stage %s (from %s)", method, stage, request.remote)
        answers = await self.orch.control(stage, method, args, timeout)
        return web.json_response({"stage": stage, "method": method, "replicas": jsonable(answers)})
