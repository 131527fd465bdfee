"""The master's HTTP API: OpenAI-compatible completions, health, readiness, metrics, control.

Requests: `/v1/chat/completions` (the entry stage gets `messages`) and
`/v1/completions` (it gets `prompt`), streaming (SSE) or not. Standard
sampling fields (temperature, max_tokens, ...) override the entry stage's
defaults; `stage_sampling_params: {stage: {...}}` (an `extra_body` field for
the openai client) overrides any stage's. Chunks of stages whose finalOutput
is `text` become the message text; chunks of other final stages travel in an
`omni` field ({stage, type, data}, bytes base64-encoded).
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from . import wire
from .orchestrator import Event, NoReplica, Orchestrator, Run
from .schema import OmniPipeline

log = logging.getLogger("omnifleet.api")

OPENAI_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "seed", "stop",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "logprobs",
)


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
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    return json.dumps(jsonable(value))


def error_response(status: int, message: str, code: str, **extra: Any) -> web.Response:
    body = {"error": {"message": message, "type": code, "code": status, **extra}}
    return web.json_response(body, status=status)


class Api:
    def __init__(self, doc: OmniPipeline, orch: Orchestrator, metrics_text, control_timeout_s: float):
        self.doc = doc
        self.spec = doc.spec
        self.orch = orch
        self.metrics_text = metrics_text
        self.control_timeout_s = control_timeout_s
        self.model_id = doc.metadata.name
        self.model_names = {self.model_id} | ({self.spec.model} if self.spec.model else set())
        self.entry = next(s.name for s in self.spec.stages if not s.inputs)
        self.final_types = {s.name: s.final_output for s in self.spec.stages if s.final_output != "none"}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics),
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/stages", self.stages),
            web.post("/v1/stages/{stage}/control", self.control),
        ])
        return app

    # ------------------------------------------------------------ probes and metrics

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        missing = self.orch.membership.missing()
        if missing:
            return web.json_response(
                {"ready": False, "missing_stages": missing,
                 "message": f"no replica of stage(s) {', '.join(missing)} is registered"},
                status=503,
            )
        return web.json_response({"ready": True})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "omnifleet"}
            for name in sorted(self.model_names)
        ]})

    async def stages(self, request: web.Request) -> web.Response:
        out = {}
        for s in self.spec.stages:
            out[s.name] = [
                {"replica": r.replica, "data_addr": r.data_addr, "inflight": r.outstanding,
                 "queue_depth": r.queue_depth, "draining": r.draining}
                for r in self.orch.membership.replicas(s.name)
            ]
        return web.json_response({"stages": out})

    async def control(self, request: web.Request) -> web.Response:
        stage = request.match_info["stage"]
        if stage not in {s.name for s in self.spec.stages}:
            return error_response(404, f"no stage named {stage!r}", "not_found")
        try:
            body = await request.json()
            method, args = body["method"], body.get("args") or {}
            timeout = float(body.get("timeout", self.control_timeout_s))
            if not isinstance(method, str) or not isinstance(args, dict):
                raise TypeError("method must be a string and args an object")
        except (ValueError, KeyError, TypeError) as e:
            return error_response(400, f"bad control request: {e}", "invalid_request_error")
        answers = await self.orch.control(stage, method, args, timeout)
        return web.json_response({"stage": stage, "method": method, "replicas": jsonable(answers)})

    # ------------------------------------------------------------ completions

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    def _sampling(self, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
        sampling = {s.name: dict(s.sampling_params) for s in self.spec.stages}
        sampling[self.entry].update({k: body[k] for k in OPENAI_SAMPLING if body.get(k) is not None})
        per_stage = body.get("stage_sampling_params") or {}
        if not isinstance(per_stage, dict):
            raise ValueError("stage_sampling_params must be an object {stage: {param: value}}")
        for stage, params in per_stage.items():
            if stage not in sampling:
                raise ValueError(f"stage_sampling_params names no stage of this pipeline: {stage!r}")
            if not isinstance(params, dict):
                raise ValueError(f"stage_sampling_params.{stage} must be an object")
            sampling[stage].update(params)
        return sampling

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            field = "messages" if kind == "chat" else "prompt"
            if body.get(field) is None:
                raise ValueError(f"{field!r} is required")
            if kind == "chat" and not isinstance(body["messages"], list):
                raise ValueError("'messages' must be a list")
            sampling = self._sampling(body)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error")
        model = body.get("model") or self.model_id
        if model not in self.model_names:
            return error_response(404, f"model {model!r} is not served here; try {self.model_id!r}",
                                  "model_not_found")
        info = wire.RequestInfo(
            request_id=f"req-{uuid.uuid4().hex}", kind=kind, model=model,
            prompt=body.get("prompt"), messages=body.get("messages"),
            extra={k: v for k, v in body.items() if k not in ("messages", "prompt")},
        )
        try:
            run = self.orch.start(info, sampling)
        except NoReplica as e:
            self.orch.metrics.requests.inc(api=kind, outcome="no_replica")
            return error_response(503, str(e), "service_unavailable", stages=e.stages)
        try:
            if body.get("stream"):
                return await self._stream(request, run, kind)
            return await self._collect(run, kind)
        finally:
            self.orch.abort(run)  # a no-op once the request finished; stops every stage if the client left

    def _chunk(self, run: Run, kind: str, ev: Event | None, first: bool) -> dict[str, Any]:
        created = int(time.time())
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            finish = None
            if ev is None:
                finish = "stop"
            elif self.final_types[ev.stage] == "text":
                delta["content"] = as_text(ev.payload)
            else:
                delta["omni"] = self._omni(ev)
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": "", "finish_reason": None if ev else "stop", "logprobs": None}
            if ev is not None:
                if self.final_types[ev.stage] == "text":
                    choice["text"] = as_text(ev.payload)
                else:
                    choice["omni"] = self._omni(ev)
            obj = "text_completion"
        return {"id": run.id, "object": obj, "created": created, "model": run.info.model, "choices": [choice]}

    def _omni(self, ev: Event) -> dict[str, Any]:
        return {"stage": ev.stage, "type": self.final_types[ev.stage], "data": jsonable(ev.payload)}

    async def _stream(self, request: web.Request, run: Run, kind: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")  # noqa: E731
        first = True
        try:
            while True:
                ev: Event = await run.events.get()
                if ev.kind == "output":
                    await send(self._chunk(run, kind, ev, first))
                    first = False
                elif ev.kind == "error":
                    await send({"error": {"message": ev.message, "type": ev.code, "code": ev.status}})
                    break
                else:
                    await send(self._chunk(run, kind, None, first))
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return resp

    async def _collect(self, run: Run, kind: str) -> web.Response:
        text: list[str] = []
        omni: list[dict[str, Any]] = []
        while True:
            ev: Event = await run.events.get()
            if ev.kind == "error":
                return error_response(ev.status, ev.message, ev.code)
            if ev.kind == "end":
                break
            if self.final_types[ev.stage] == "text":
                text.append(as_text(ev.payload))
            else:
                omni.append(self._omni(ev))
        content = "".join(text)
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if omni:
                message["omni"] = omni
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "finish_reason": "stop", "logprobs": None}
            if omni:
                choice["omni"] = omni
            obj = "text_completion"
        return web.json_response({
            "id": run.id, "object": obj, "created": int(time.time()), "model": run.info.model,
            "choices": [choice],
        })

