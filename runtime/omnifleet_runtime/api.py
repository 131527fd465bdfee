"""The master's HTTP API: OpenAI-compatible completions, images, speech, health, readiness, metrics, control.

Requests: `/v1/chat/completions` (the entry stage gets `messages`) and
`/v1/completions` (it gets `prompt`), streaming (SSE) or not. Standard
sampling fields (temperature, max_tokens, ...) override the entry stage's
defaults; `stage_sampling_params: {stage: {...}}` (an `extra_body` field for
the openai client) overrides any stage's. Chunks of stages whose finalOutput
is `text` become the message text (an llm stage's chunk is a dict: its `text`;
`return_token_ids: true` adds the `token_ids` to each choice, as vLLM's server
does); chunks of other final stages travel in an `omni` field ({stage, type,
data}, bytes base64-encoded).

`modalities` picks the final outputs a chat request gets (default: the text
ones; all when the pipeline has no text output), and only the stages they need
run. With `"audio"` the reply carries `message.audio` as OpenAI shapes it
(`{id, data: base64 WAV (or pcm16 with audio.format "pcm16"), expires_at,
transcript}`; streamed: `delta.audio.data`, base64 16-bit PCM).

`/v1/images/generations` runs the stages that feed the `image` final stages
(the entry stage gets `prompt`); `n`, `size` ("WxH") and `seed` become those
stages' `n`, `width`, `height`, `seed`; the answer is PNGs, `b64_json` or
`url` (a data: URL). `/v1/audio/speech` runs those feeding the `audio` final
stages (the entry stage gets `input` as its prompt) and answers a WAV
(`response_format` wav, the default here), raw 16-bit PCM streamed as it comes
(`pcm`), or SSE `speech.audio.delta` events (`stream_format: "sse"`). PNG and
WAV are encoded here with the standard library (media.py).
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from . import media, wire
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
    if isinstance(value, dict) and isinstance(value.get("text"), str):  # an llm stage's chunk
        return value["text"]
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
            web.post("/v1/images/generations", self.images),
            web.post("/v1/audio/speech", self.speech),
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

    def _sampling(self, body: dict[str, Any], top_level: bool = True) -> dict[str, dict[str, Any]]:
        sampling = {s.name: dict(s.sampling_params) for s in self.spec.stages}
        if top_level:
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

    def _finals(self, body: dict[str, Any]) -> set[str]:
        """The final stages a chat or completion request gets, from its `modalities`."""
        modalities = body.get("modalities")
        if modalities is None:
            text = {s for s, t in self.final_types.items() if t == "text"}
            return text or set(self.final_types)
        if not isinstance(modalities, list) or not modalities or not all(isinstance(m, str) for m in modalities):
            raise ValueError("'modalities' must be a non-empty list of strings")
        absent = [m for m in modalities if m not in self.final_types.values()]
        if absent:
            have = sorted(set(self.final_types.values()))
            raise ValueError(f"this pipeline has no final output of modality {', '.join(map(repr, absent))} "
                             f"(it has {', '.join(have)})")
        return {s for s, t in self.final_types.items() if t in modalities}

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any]) -> str | web.Response:
        model = body.get("model") or self.model_id
        if model not in self.model_names:
            return error_response(404, f"model {model!r} is not served here; try {self.model_id!r}",
                                  "model_not_found")
        return model

    def _start(self, info: wire.RequestInfo, sampling: dict[str, dict[str, Any]],
               final: set[str]) -> Run | web.Response:
        try:
            return self.orch.start(info, sampling, final)
        except NoReplica as e:
            self.orch.metrics.requests.inc(api=info.kind, outcome="no_replica")
            return error_response(503, str(e), "service_unavailable", stages=e.stages)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await self._body(request)
            field = "messages" if kind == "chat" else "prompt"
            if body.get(field) is None:
                raise ValueError(f"{field!r} is required")
            if kind == "chat" and not isinstance(body["messages"], list):
                raise ValueError("'messages' must be a list")
            sampling = self._sampling(body)
            final = self._finals(body)
            audio_format = _audio_format(body) if kind == "chat" else None
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error")
        model = self._model(body)
        if isinstance(model, web.Response):
            return model
        info = wire.RequestInfo(
            request_id=f"req-{uuid.uuid4().hex}", kind=kind, model=model,
            prompt=body.get("prompt"), messages=body.get("messages"),
            extra={k: v for k, v in body.items() if k not in ("messages", "prompt")},
        )
        run = self._start(info, sampling, final)
        if isinstance(run, web.Response):
            return run
        reply = Reply(kind, bool(body.get("return_token_ids")),
                      audio_format if kind == "chat" and "audio" in (body.get("modalities") or []) else None)
        try:
            if body.get("stream"):
                return await self._stream(request, run, reply)
            return await self._collect(run, reply)
        finally:
            self.orch.abort(run)  # a no-op once the request finished; stops every stage if the client left

    def _chunk(self, run: Run, reply: "Reply", ev: Event | None, first: bool) -> dict[str, Any]:
        created = int(time.time())
        kind = reply.kind
        ftype = self.final_types[ev.stage] if ev is not None else None
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            finish = None
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            if ev is None:
                finish = "stop"
            elif ftype == "text":
                delta["content"] = as_text(ev.payload)
                if reply.token_ids:
                    choice["token_ids"] = _token_ids(ev.payload)
            elif ftype == "audio" and reply.audio:
                delta["audio"] = {"id": reply.audio_id,
                                  "data": base64.b64encode(media.audio_of(ev.payload).pcm).decode()}
            else:
                delta["omni"] = self._omni(ev)
            choice.update(finish_reason=finish, logprobs=None)
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": "", "finish_reason": None if ev else "stop", "logprobs": None}
            if ev is not None:
                if ftype == "text":
                    choice["text"] = as_text(ev.payload)
                    if reply.token_ids:
                        choice["token_ids"] = _token_ids(ev.payload)
                else:
                    choice["omni"] = self._omni(ev)
            obj = "text_completion"
        return {"id": run.id, "object": obj, "created": created, "model": run.info.model, "choices": [choice]}

    def _omni(self, ev: Event) -> dict[str, Any]:
        return {"stage": ev.stage, "type": self.final_types[ev.stage], "data": jsonable(ev.payload)}

    async def _stream(self, request: web.Request, run: Run, reply: "Reply") -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")  # noqa: E731
        first = True
        try:
            while True:
                ev: Event = await run.events.get()
                if ev.kind == "output":
                    try:
                        chunk = self._chunk(run, reply, ev, first)
                    except media.MediaError as e:
                        await send({"error": {"message": f"stage {ev.stage!r}: {e}", "type": "bad_output",
                                              "code": 502}})
                        break
                    await send(chunk)
                    first = False
                elif ev.kind == "error":
                    await send({"error": {"message": ev.message, "type": ev.code, "code": ev.status}})
                    break
                else:
                    await send(self._chunk(run, reply, None, first))
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return resp

    async def _events(self, run: Run) -> tuple[list[Event], Event | None]:
        """Every output event of a finished run, or the error event that ended it."""
        out: list[Event] = []
        while True:
            ev: Event = await run.events.get()
            if ev.kind == "error":
                return out, ev
            if ev.kind == "end":
                return out, None
            out.append(ev)

    async def _collect(self, run: Run, reply: "Reply") -> web.Response:
        events, err = await self._events(run)
        if err is not None:
            return error_response(err.status, err.message, err.code)
        text: list[str] = []
        ids: list[int] = []
        omni: list[dict[str, Any]] = []
        audio: list[media.Audio] = []
        try:
            for ev in events:
                ftype = self.final_types[ev.stage]
                if ftype == "text":
                    text.append(as_text(ev.payload))
                    ids += _token_ids(ev.payload)
                elif ftype == "audio" and reply.audio:
                    audio.append(media.audio_of(ev.payload))
                else:
                    omni.append(self._omni(ev))
            content = "".join(text)
            if reply.audio:
                sound = media.join_audio(audio)
                data = media.wav(sound) if reply.audio == "wav" else sound.pcm
        except media.MediaError as e:
            return error_response(502, f"a final stage sent output that cannot be encoded: {e}", "bad_output")
        if reply.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reply.audio:
                message["audio"] = {"id": reply.audio_id, "data": base64.b64encode(data).decode(),
                                    "expires_at": int(time.time()) + 3600, "transcript": content}
            if omni:
                message["omni"] = omni
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "finish_reason": "stop", "logprobs": None}
            if omni:
                choice["omni"] = omni
            obj = "text_completion"
        if reply.token_ids:
            choice["token_ids"] = ids
        return web.json_response({
            "id": run.id, "object": obj, "created": int(time.time()), "model": run.info.model,
            "choices": [choice],
        })

    # ------------------------------------------------------------ images and speech

    def _stages_of(self, modality: str) -> set[str]:
        return {s for s, t in self.final_types.items() if t == modality}

    async def images(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("'prompt' is required (a string)")
            final = self._stages_of("image")
            if not final:
                raise ValueError("this pipeline has no image output (no stage with finalOutput: image)")
            n = body.get("n") if body.get("n") is not None else 1
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
                raise ValueError("'n' must be an integer from 1 to 16")
            fmt = body.get("response_format") or "b64_json"
            if fmt not in ("b64_json", "url"):
                raise ValueError("'response_format' must be 'b64_json' or 'url'")
            params: dict[str, Any] = {"n": n}
            size = body.get("size")
            if size not in (None, "auto"):
                w, _, h = str(size).partition("x")
                if not (w.isdigit() and h.isdigit() and 0 < int(w) <= 4096 and 0 < int(h) <= 4096):
                    raise ValueError(f"'size' must be WIDTHxHEIGHT (e.g. 256x256), got {size!r}")
                params.update(width=int(w), height=int(h))
            if body.get("seed") is not None:
                params["seed"] = body["seed"]
            sampling = self._sampling(body, top_level=False)
            for stage in final:
                sampling[stage].update(params)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error")
        run = self._start_for(body, "image", "img", "prompt", sampling, final)
        if isinstance(run, web.Response):
            return run
        try:
            events, err = await self._events(run)
        finally:
            self.orch.abort(run)
        if err is not None:
            return error_response(err.status, err.message, err.code)
        try:
            pngs = [p for ev in events for p in media.images_of(ev.payload)]
        except media.MediaError as e:
            return error_response(502, f"the image stage sent output that cannot be encoded: {e}", "bad_output")
        key = "b64_json" if fmt == "b64_json" else "url"
        prefix = "" if fmt == "b64_json" else "data:image/png;base64,"
        return web.json_response({"created": int(time.time()), "data": [
            {key: prefix + base64.b64encode(p).decode()} for p in pngs]})

    def _start_for(self, body: dict, kind: str, id_prefix: str, prompt_key: str,
                   sampling: dict, final: list[str]) -> Any:
        """Start a request whose prompt is body[prompt_key]: the run, or an error response."""
        model = self._model(body)
        if isinstance(model, web.Response):
            return model
        info = wire.RequestInfo(request_id=f"{id_prefix}-{uuid.uuid4().hex}", kind=kind, model=model,
                                prompt=body[prompt_key], extra={k: v for k, v in body.items() if k != prompt_key})
        return self._start(info, sampling, final)

    async def speech(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            text = body.get("input")
            if not isinstance(text, str) or not text:
                raise ValueError("'input' is required (a string)")
            final = self._stages_of("audio")
            if not final:
                raise ValueError("this pipeline has no audio output (no stage with finalOutput: audio)")
            fmt = body.get("response_format") or "wav"
            if fmt not in ("wav", "pcm"):
                raise ValueError(f"response_format {fmt!r} is not supported here; use 'wav' or 'pcm'")
            stream_format = body.get("stream_format") or "audio"
            if stream_format not in ("audio", "sse"):
                raise ValueError("'stream_format' must be 'audio' or 'sse'")
            sampling = self._sampling(body, top_level=False)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error")
        run = self._start_for(body, "speech", "tts", "input", sampling, final)
        if isinstance(run, web.Response):
            return run
        try:
            if stream_format == "sse" or fmt == "pcm":
                return await self._stream_speech(request, run, sse=stream_format == "sse")
            events, err = await self._events(run)
            if err is not None:
                return error_response(err.status, err.message, err.code)
            try:
                data = media.wav(media.join_audio([media.audio_of(ev.payload) for ev in events]))
            except media.MediaError as e:
                return error_response(502, f"the audio stage sent output that cannot be encoded: {e}",
                                      "bad_output")
            return web.Response(body=data, content_type="audio/wav")
        finally:
            self.orch.abort(run)

    async def _stream_speech(self, request: web.Request, run: Run, sse: bool) -> web.StreamResponse:
        """PCM as the audio stages produce it: raw bytes, or SSE speech.audio.delta events."""
        resp: web.StreamResponse | None = None
        try:
            while True:
                ev: Event = await run.events.get()
                if ev.kind == "error" and resp is None:
                    return error_response(ev.status, ev.message, ev.code)
                if resp is None:
                    rate = media.audio_of(ev.payload).sample_rate if ev.kind == "output" else media.DEFAULT_SAMPLE_RATE
                    ctype = "text/event-stream" if sse else "audio/pcm"
                    resp = web.StreamResponse(headers={"Content-Type": ctype, "Cache-Control": "no-cache",
                                                       "X-Sample-Rate": str(rate)})
                    await resp.prepare(request)
                if ev.kind == "output":
                    pcm = media.audio_of(ev.payload).pcm
                    if sse:
                        event = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()}
                        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    else:
                        await resp.write(pcm)
                    continue
                if sse:
                    event = ({"type": "speech.audio.done"} if ev.kind == "end" else
                             {"type": "error", "error": {"message": ev.message, "type": ev.code, "code": ev.status}})
                    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                break
            await resp.write_eof()
        except media.MediaError as e:
            if resp is None:
                return error_response(502, f"the audio stage sent output that cannot be encoded: {e}", "bad_output")
            log.warning("request %s: %s", run.id, e)  # mid-stream: the client sees the stream end early
        except ConnectionResetError:
            pass
        return resp


class Reply:
    """How one chat or completion request wants its answer shaped."""

    def __init__(self, kind: str, token_ids: bool, audio: str | None):
        self.kind = kind
        self.token_ids = token_ids
        self.audio = audio  # None, "wav" or "pcm16"
        self.audio_id = f"audio_{uuid.uuid4().hex[:24]}"


def _audio_format(body: dict[str, Any]) -> str:
    audio = body.get("audio") or {}
    if not isinstance(audio, dict):
        raise ValueError("'audio' must be an object {voice, format}")
    fmt = audio.get("format") or "wav"
    if fmt not in ("wav", "pcm16"):
        raise ValueError(f"audio.format {fmt!r} is not supported here; use 'wav' or 'pcm16'")
    return fmt


def _token_ids(payload: Any) -> list[int]:
    if isinstance(payload, dict) and isinstance(payload.get("token_ids"), list):
        return payload["token_ids"]
    return []
