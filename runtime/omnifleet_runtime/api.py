"""The master's public HTTP API: OpenAI-compatible completions, images, speech; health, readiness, metrics.

Requests: `/v1/chat/completions` (the entry stage gets `messages`) and
`/v1/completions` (it gets `prompt`), streaming (SSE) or not. Standard
sampling fields (temperature, max_tokens, ...) override the entry stage's
defaults; `stage_sampling_params: {stage: {...}}` (an `extra_body` field for
the openai client) overrides any stage's. Chunks of stages whose finalOutput
is `text` become the message text (an llm stage's chunk is a dict: its `text`;
`return_token_ids: true` adds the `token_ids` to each choice, as vLLM's server
does); chunks of other final stages travel in an `omni` field ({stage, type,
data}, bytes base64-encoded).

`modalities` picks the final outputs a chat or completion request gets
(default: the text ones; all when the pipeline has no text output), and only
the stages they need run. With `"audio"` the reply carries `message.audio` as OpenAI shapes it
(`{id, data: base64 WAV (or FLAC, MP3, pcm16 per audio.format), expires_at,
transcript}`; streamed: `delta.audio.data`, base64 16-bit PCM).

`/v1/images/generations` runs the stages that feed the `image` final stages
(the entry stage gets `prompt`); `n`, `size` ("WxH") and `seed` become those
stages' `n`, `width`, `height`, `seed`; the answer is PNGs, `b64_json` or
`url` (a data: URL). `/v1/audio/speech` runs those feeding the `audio` final
stages (the entry stage gets `input` as its prompt) and answers a WAV
(`response_format` wav, the default here), FLAC or MP3, raw 16-bit PCM streamed
as it comes (`pcm`), or SSE `speech.audio.delta` events (`stream_format:
"sse"`). `/v1/audio/transcriptions` (OpenAI's multipart form) hands the entry
stage a chat message of the audio file and an instruction ("Transcribe the
audio.", with `language` and `prompt` added) and answers the text final
outputs as `{text, usage}`, plain text, or SSE `transcript.text.delta` events. PNG and WAV are encoded here with the standard library, FLAC and MP3
with libsndfile (media.py). Chat content parts with images and audio are
decoded here once (content.py).

Who may call what: with an API key configured (spec.master.apiKeySecret),
every `/v1/` endpoint wants `Authorization: Bearer <key>` (401 otherwise);
`/health`, `/ready`, `/readyz` and `/metrics` stay open for probes and scrapers. The
admin endpoints live on another port (admin.py). Every body is checked by
limits.py before anything is dispatched (400 naming the field); at most
`maxInflight` requests are served at once (429 with Retry-After beyond);
every request has a deadline (504 past it). Encoding (PNG, WAV, base64, big
JSON) runs in worker threads so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
import uuid
from typing import Any

from aiohttp import web

from . import constants as C
from . import media, wire
from .content import decode_messages, fetch_bounded, has_media
from .httputil import as_text, bearer_ok, error_response, jsonable, unauthorized
from .limits import OPENAI_SAMPLING, BadRequest, RequestCheck, parse_body
from .orchestrator import Event, NoReplica, Orchestrator, Run
from .schema import OmniPipeline

log = logging.getLogger("omnifleet.api")

RETRY_AFTER_S = 1
BODY_READ_TIMEOUT_S = 30.0  # a client trickling its body holds an admission slot only this long
INLINE_BYTES = 64 * 1024  # smaller payloads are encoded on the loop: a thread hop would cost more


class Api:
    def __init__(self, doc: OmniPipeline, orch: Orchestrator, metrics_text, api_key: str | None = None):
        self.doc = doc
        self.spec = doc.spec
        self.limits = doc.spec.master.limits
        self.orch = orch
        self.metrics = orch.metrics
        self.metrics_text = metrics_text
        self.api_key = api_key or None
        self.check = RequestCheck(self.limits, [s.name for s in self.spec.stages],
                                  doc.spec.master.trust_request_chat_template,
                                  companions=any(s.prompt_expand for s in self.spec.stages))
        self.inflight = 0
        self.draining = False  # SIGTERM: no new request; those in flight finish (master.py)
        self.last_arrival, self.drain_arrivals = 0.0, 0  # API requests while draining: the last's time, count
        self.started, self.warm = time.monotonic(), False  # see readyz
        self.model_id = doc.metadata.name
        self.model_names = {self.model_id} | ({self.spec.model} if self.spec.model else set())
        # LoRA adapters by name, and the stages that serve each (the others run their base model).
        self.loras: dict[str, list[str]] = {}
        for st in self.spec.stages:
            for lora in st.loras:
                self.loras.setdefault(lora.name, []).append(st.name)
        entry = next(s for s in self.spec.stages if not s.inputs)
        self.entry, self.entry_type = entry.name, entry.type  # vLLM stages decode videos
        self.final_types = {s.name: s.final_output for s in self.spec.stages if s.final_output != "none"}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._guard])
        app.add_routes([
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_endpoint),
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.post("/v1/images/generations", self.images),
            web.post("/v1/audio/speech", self.speech),
            web.post("/v1/audio/transcriptions", self.transcriptions),
        ])
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """The API key on /v1/, and the bound on requests served at once."""
        if not request.path.startswith("/v1/"):
            return await handler(request)
        if not self.draining:
            return await self._admit(request, handler)
        self.last_arrival = time.monotonic()
        self.drain_arrivals += 1
        resp = await self._admit(request, handler)
        resp.force_close()  # a keep-alive client's next request opens a new connection, which the proxy routes anew
        return resp

    async def _admit(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key is not None and not bearer_ok(request, self.api_key):
            self.metrics.refused.inc(reason="unauthorized")
            return unauthorized("this API wants an API key")
        if request.method != "POST":
            return await handler(request)
        if self.draining:
            self.metrics.refused.inc(reason="draining")
            return error_response(503, "the master is shutting down; retry (another master takes over)",
                                  "unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.inflight >= self.limits.max_inflight:
            self.metrics.refused.inc(reason="full")
            return error_response(429, f"the master is serving {self.limits.max_inflight} requests, its limit "
                                  "(spec.master.limits.maxInflight); retry later", "too_many_requests",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        self.inflight += 1
        try:
            return await handler(request)
        finally:
            self.inflight -= 1

    # ------------------------------------------------------------ probes and metrics

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _missing(self) -> list[str]:
        """Stages without a replica that takes new work, but for those that scale to zero (idle, not missing:
        their requests wait for one)."""
        return [s for s in self.orch.membership.missing() if s not in self.orch.activation_s]

    async def readyz(self, request: web.Request) -> web.Response:
        """The master pod's readiness probe. A new master takes requests through the Service once every
        stage has a replica registered with it (the stages find it within seconds: without this wait its
        first requests would get 503 no replica while another master serves), or MASTER_WARMUP_S after it
        started (then a stage without replicas gets its requests' clear 503s). Once ready it stays so: a
        stage lost later is the pipeline's outage (/ready), not this master's, and its clients get a 503
        naming the stage, not a refused connection. Draining, it is not ready: a terminating pod that is
        still ready keeps getting new connections wherever no other master is ready (kube-proxy falls back
        to terminating endpoints that serve), so its drain would end while they still come."""
        if self.draining:
            return web.json_response({"ready": False, "draining": True}, status=503)
        if not self.warm:
            missing = self._missing()
            if missing and time.monotonic() - self.started < C.MASTER_WARMUP_S:
                return web.json_response({"ready": False, "waiting_for": missing}, status=503)
            self.warm = True
        return web.json_response({"ready": True})

    async def ready(self, request: web.Request) -> web.Response:
        """Open (the operator reads it through the API server's service proxy): stage names, counts
        and the last refused registration per stage, nothing secret."""
        ms, now = self.orch.membership, time.monotonic()
        stages = {}
        for s in ms.stages:
            entry: dict[str, Any] = {"registered": len(ms.replicas(s)), "routable": len(ms.routable(s))}
            present = ms.revisions_present(s)
            if len(present) > 1:  # a rollout: replicas of each revision (the newest serves once complete)
                entry["revisions"] = {rev[:12] or "unknown": n for rev, n in sorted(present.items())}
            if s in ms.refusals:
                when, reason = ms.refusals[s]
                entry["lastRefusal"] = {"reason": reason, "secondsAgo": round(now - when, 1)}
            stages[s] = entry
        missing = self._missing()
        for s in ms.missing():
            if s in self.orch.activation_s:
                stages[s]["scaledToZero"] = True
        if self.draining:
            return web.json_response({"ready": False, "draining": True, "stages": stages,
                                      "message": "the master is shutting down"}, status=503)
        if missing:
            return web.json_response(
                {"ready": False, "missing_stages": missing, "stages": stages,
                 "message": f"no replica of stage(s) {', '.join(missing)} is registered"},
                status=503,
            )
        if ms.combo([s for s in ms.stages if ms.routable(s)]) is None:
            return web.json_response({"ready": False, "stages": stages, "message": ms.lacking(ms.stages)}, status=503)
        return web.json_response({"ready": True, "stages": stages})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "omnifleet"}
            for name in sorted(self.model_names)
        ] + [
            {"id": name, "object": "model", "created": 0, "owned_by": "omnifleet", "parent": self.model_id,
             "stages": stages} for name, stages in sorted(self.loras.items()) if name not in self.model_names
        ]})

    # ------------------------------------------------------------ completions

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _checked(self, request: web.Request, kind: str) -> dict[str, Any]:
        """The request's body, checked: the known keys, their types, the limits."""
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                raw = await request.read()
        except TimeoutError:
            raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g}s")
        body = parse_body(raw)
        self.check.check(kind, body)
        return body

    def _invalid(self, e: BadRequest) -> web.Response:
        self.metrics.refused.inc(reason="invalid")
        return error_response(400, str(e), "invalid_request_error")

    def _sampling(self, body: dict[str, Any], top_level: bool = True) -> dict[str, dict[str, Any]]:
        sampling = {s.name: dict(s.sampling_params) for s in self.spec.stages}
        if top_level:
            sampling[self.entry].update({k: body[k] for k in OPENAI_SAMPLING if body.get(k) is not None})
        for stage, params in (body.get("stage_sampling_params") or {}).items():
            sampling[stage].update(params)
        return sampling

    def _finals(self, body: dict[str, Any]) -> set[str]:
        """The final stages a chat or completion request gets, from its `modalities`."""
        modalities = body.get("modalities")
        if modalities is None:
            text = {s for s, t in self.final_types.items() if t == "text"}
            return text or set(self.final_types)
        if not isinstance(modalities, list) or not modalities or not all(isinstance(m, str) for m in modalities):
            raise BadRequest("'modalities' must be a non-empty list of strings")
        absent = [m for m in modalities if m not in self.final_types.values()]
        if absent:
            have = sorted(set(self.final_types.values()))
            raise BadRequest(f"this pipeline has no final output of modality {', '.join(map(repr, absent))} "
                             f"(it has {', '.join(have)})")
        return {s for s, t in self.final_types.items() if t in modalities}

    def _model(self, body: dict[str, Any]) -> str | web.Response:
        model = body.get("model") or self.model_id
        if model not in self.model_names and model not in self.loras:
            adapters = f" or a LoRA adapter ({', '.join(sorted(self.loras))})" if self.loras else ""
            return error_response(404, f"model {model[:256]!r} is not served here; try {self.model_id!r}{adapters}",
                                  "model_not_found")
        return model

    def _start(self, body: dict[str, Any], kind: str, id_prefix: str, prompt_key: str,
               sampling: dict[str, dict[str, Any]], final: set[str]) -> Run | web.Response:
        """Start a request whose prompt is body[prompt_key]: the run, or an error response."""
        model = self._model(body)
        if isinstance(model, web.Response):
            return model
        prompt = body.get(prompt_key)
        info = wire.RequestInfo(
            request_id=f"{id_prefix}-{uuid.uuid4().hex}", kind=kind, model=model,
            lora=model if model in self.loras and model not in self.model_names else "",
            prompt=None if prompt_key == "messages" else prompt, messages=prompt if prompt_key == "messages" else None,
            extra={k: v for k, v in body.items() if k != prompt_key},  # the known keys only (limits.py)
        )
        try:
            return self.orch.start(info, sampling, final, timeout_s=self.check.timeout(body))
        except NoReplica as e:
            self.metrics.requests.inc(api=info.kind, outcome="no_replica")
            return error_response(503, str(e), "service_unavailable", stages=e.stages)

    async def _decode_media(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        lim = self.spec.master.limits
        return await decode_messages(
            messages, max_image_pixels=lim.max_image_pixels, max_audio_seconds=lim.max_input_audio_seconds,
            max_bytes=lim.max_body_bytes, hosts=frozenset(self.spec.master.media_url_hosts), fetch=fetch_bounded,
            max_video_frames=lim.max_video_frames, max_video_pixels=lim.max_video_pixels,
            video_file=self.entry_type in ("llm", "vllm-omni"))

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await self._checked(request, kind)
            sampling = self._sampling(body)
            final = self._finals(body)
            audio_format = _audio_format(body, kind)
        except BadRequest as e:
            return self._invalid(e)
        if kind == "chat" and has_media(body["messages"]):
            try:
                body["messages"] = await self._decode_media(body["messages"])
            except BadRequest as e:
                return self._invalid(e)
        runs: list[Run] = []
        n = body.get("n") or 1
        for i in range(n):  # n choices: n runs of the whole pipeline, one choice each
            run = self._start(body, kind, "req", "messages" if kind == "chat" else "prompt",
                              _nth(sampling, self.entry, i) if n > 1 else sampling, final)
            if isinstance(run, web.Response):
                for started in runs:
                    self.orch.abort(started)
                return run
            runs.append(run)
        reply = Reply(kind, bool(body.get("return_token_ids")),
                      audio_format if kind == "chat" and "audio" in (body.get("modalities") or []) else None)
        options = body.get("stream_options")
        reply.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        try:
            if body.get("stream"):
                return await self._stream(request, runs, reply)
            return await self._collect(runs, reply)
        finally:
            for run in runs:  # a no-op once the request finished; stops every stage if the client left
                self.orch.abort(run)

    def _chunk(self, run: Run, reply: "Reply", ev: Event | None, first: bool, index: int = 0,
               ident: str | None = None) -> dict[str, Any]:
        created = int(time.time())
        kind = reply.kind
        ftype = self.final_types[ev.stage] if ev is not None else None
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            finish = None
            choice: dict[str, Any] = {"index": index, "delta": delta}
            if ev is None:
                finish = "stop"
            elif ftype == "text":
                delta["content"] = as_text(ev.payload)
                if reply.token_ids:
                    choice["token_ids"] = _token_ids(ev.payload)
            elif ftype == "audio" and reply.audio:
                delta["audio"] = {"id": reply.audio_id, "data": base64.b64encode(
                    media.audio_of(ev.payload, self.limits.max_audio_seconds).pcm).decode()}
            else:
                delta["omni"] = self._omni(ev)
            choice.update(finish_reason=finish, logprobs=None)
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": "", "finish_reason": None if ev else "stop", "logprobs": None}
            if ev is not None:
                if ftype == "text":
                    choice["text"] = as_text(ev.payload)
                    if reply.token_ids:
                        choice["token_ids"] = _token_ids(ev.payload)
                else:
                    choice["omni"] = self._omni(ev)
            obj = "text_completion"
        return {"id": ident or run.id, "object": obj, "created": created, "model": run.info.model,
                "choices": [choice]}

    def _omni(self, ev: Event) -> dict[str, Any]:
        return {"stage": ev.stage, "type": self.final_types[ev.stage], "data": jsonable(ev.payload)}

    async def _stream(self, request: web.Request, runs: list[Run], reply: "Reply") -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        send = lambda obj: resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")  # noqa: E731
        merged: asyncio.Queue = asyncio.Queue()  # (choice index, event) of every run, as they come

        async def forward(i: int, run: Run) -> None:
            while True:
                ev: Event = await run.events.get()
                merged.put_nowait((i, ev))
                if ev.kind != "output":
                    return

        loop = asyncio.get_running_loop()
        forwarders = [loop.create_task(forward(i, run)) for i, run in enumerate(runs)]
        first, usages = [True] * len(runs), []
        try:
            while True:
                i, ev = await merged.get()
                run = runs[i]
                if ev.kind == "output":
                    try:
                        chunk = await off_loop(ev.payload, lambda: _sse(self._chunk(
                            run, reply, ev, first[i], index=i, ident=runs[0].id)))
                    except media.MediaError as e:
                        await send({"error": {"message": f"stage {ev.stage!r}: {e}", "type": "bad_output",
                                              "code": 502}})
                        break
                    await resp.write(chunk)
                    first[i] = False
                elif ev.kind == "error":
                    await send({"error": {"message": ev.message, "type": ev.code, "code": ev.status}})
                    break
                else:
                    await send(self._chunk(run, reply, None, first[i], index=i, ident=runs[0].id))
                    usages.append(ev.payload)
                    if len(usages) < len(runs):
                        continue
                    if reply.include_usage:  # as OpenAI: one more chunk, no choices, the usage
                        await send({**self._chunk(run, reply, None, False, ident=runs[0].id), "choices": [],
                                    "usage": _sum_usage(usages)})
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        finally:
            for task in forwarders:
                task.cancel()
        return resp

    async def _events(self, run: Run) -> tuple[list[Event], Event]:
        """Every output event of a finished run, and the event that ended it (end, with the usage, or error)."""
        out: list[Event] = []
        while True:
            ev: Event = await run.events.get()
            if ev.kind in ("error", "end"):
                return out, ev
            out.append(ev)

    async def _collect(self, runs: list[Run], reply: "Reply") -> web.Response:
        results = await asyncio.gather(*(self._events(run) for run in runs))
        for _, last in results:
            if last.kind == "error":
                return error_response(last.status, last.message, last.code)
        try:
            body = await off_loop([ev.payload for events, _ in results for ev in events],
                                  lambda: self._collected(runs, reply, results))
        except media.MediaError as e:
            return error_response(502, f"a final stage sent output that cannot be encoded: {e}", "bad_output")
        return web.Response(body=body, content_type="application/json")

    def _collected(self, runs: list[Run], reply: "Reply", results: list[tuple[list[Event], Event]]) -> bytes:
        """The JSON answer of a finished chat or completion request (in a worker thread when large)."""
        return json.dumps({
            "id": runs[0].id, "object": "chat.completion" if reply.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": runs[0].info.model,
            "choices": [self._choice(reply, events, i) for i, (events, _) in enumerate(results)],
            "usage": _sum_usage([last.payload for _, last in results]),
        }).encode()

    def _choice(self, reply: "Reply", events: list[Event], index: int) -> dict[str, Any]:
        text: list[str] = []
        ids: list[int] = []
        omni: list[dict[str, Any]] = []
        audio: list[media.Audio] = []
        for ev in events:
            ftype = self.final_types[ev.stage]
            if ftype == "text":
                text.append(as_text(ev.payload))
                ids += _token_ids(ev.payload)
            elif ftype == "audio" and reply.audio:
                audio.append(media.audio_of(ev.payload, self.limits.max_audio_seconds))
            else:
                omni.append(self._omni(ev))
        content = "".join(text)
        if reply.audio:
            sound = media.join_audio(audio, self.limits.max_audio_seconds)
            data = sound.pcm if reply.audio == "pcm16" else media.encode_audio(sound, reply.audio)
        if reply.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reply.audio:
                message["audio"] = {"id": f"{reply.audio_id}{f'_{index}' if index else ''}",
                                    "data": base64.b64encode(data).decode(),
                                    "expires_at": int(time.time()) + 3600, "transcript": content}
            if omni:
                message["omni"] = omni
            choice = {"index": index, "message": message, "finish_reason": "stop", "logprobs": None}
        else:
            choice = {"index": index, "text": content, "finish_reason": "stop", "logprobs": None}
            if omni:
                choice["omni"] = omni
        if reply.token_ids:
            choice["token_ids"] = ids
        return choice

    # ------------------------------------------------------------ images and speech

    def _stages_of(self, modality: str) -> set[str]:
        return {s for s, t in self.final_types.items() if t == modality}

    async def images(self, request: web.Request) -> web.Response:
        try:
            body = await self._checked(request, "image")
            final = self._stages_of("image")
            if not final:
                raise BadRequest("this pipeline has no image output (no stage with finalOutput: image)")
            n = body.get("n") if body.get("n") is not None else 1
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.limits.max_n:
                raise BadRequest(f"'n' must be an integer from 1 to {self.limits.max_n}")
            fmt = body.get("response_format") or "b64_json"
            if fmt not in ("b64_json", "url"):
                raise BadRequest("'response_format' must be 'b64_json' or 'url'")
            params: dict[str, Any] = {"n": n}
            size = self.check.image_size(body.get("size"))
            if size is not None:
                params.update(width=size[0], height=size[1])
            if body.get("seed") is not None:
                params["seed"] = body["seed"]
            sampling = self._sampling(body, top_level=False)
            for stage in final:
                sampling[stage].update(params)
        except BadRequest as e:
            return self._invalid(e)
        run = self._start(body, "image", "img", "prompt", sampling, final)
        if isinstance(run, web.Response):
            return run
        try:
            events, last = await self._events(run)
        finally:
            self.orch.abort(run)
        if last.kind == "error":
            return error_response(last.status, last.message, last.code)
        key = "b64_json" if fmt == "b64_json" else "url"
        prefix = "" if fmt == "b64_json" else "data:image/png;base64,"

        def encode() -> bytes:
            pngs = [p for ev in events for p in media.images_of(ev.payload, self.limits.max_image_pixels)]
            return json.dumps({"created": int(time.time()), "data": [
                {key: prefix + base64.b64encode(p).decode()} for p in pngs]}).encode()

        try:
            data = await asyncio.to_thread(encode)
        except media.MediaError as e:
            return error_response(502, f"the image stage sent output that cannot be encoded: {e}", "bad_output")
        return web.Response(body=data, content_type="application/json")

    async def speech(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._checked(request, "speech")
            final = self._stages_of("audio")
            if not final:
                raise BadRequest("this pipeline has no audio output (no stage with finalOutput: audio)")
            fmt = body.get("response_format") or "wav"
            if fmt not in ("pcm", *media.AUDIO_TYPES):
                raise BadRequest(f"response_format {str(fmt)[:32]!r} is not supported here; use one of "
                                 f"{', '.join(('pcm', *media.AUDIO_TYPES))}")
            stream_format = body.get("stream_format") or "audio"
            if stream_format not in ("audio", "sse"):
                raise BadRequest("'stream_format' must be 'audio' or 'sse'")
            sampling = self._sampling(body, top_level=False)
        except BadRequest as e:
            return self._invalid(e)
        run = self._start(body, "speech", "tts", "input", sampling, final)
        if isinstance(run, web.Response):
            return run
        try:
            if stream_format == "sse" or fmt == "pcm":
                return await self._stream_speech(request, run, sse=stream_format == "sse")
            events, last = await self._events(run)
            if last.kind == "error":
                return error_response(last.status, last.message, last.code)
            seconds = self.limits.max_audio_seconds
            try:
                data = await asyncio.to_thread(lambda: media.encode_audio(media.join_audio(
                    [media.audio_of(ev.payload, seconds) for ev in events], seconds), fmt))
            except media.MediaError as e:
                return error_response(502, f"the audio stage sent output that cannot be encoded: {e}",
                                      "bad_output")
            return web.Response(body=data, content_type=media.AUDIO_TYPES[fmt])
        finally:
            self.orch.abort(run)

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's transcription form (multipart: `file`, `model`, `prompt`, `language`, `temperature`,
        `response_format` json | text, `stream`): the entry stage hears the file as a chat message's audio
        part with an instruction, and the pipeline's text outputs are the transcript."""
        try:
            final = self._stages_of("text")
            if not final:
                raise BadRequest("this pipeline has no text output (no stage with finalOutput: text)")
            try:
                async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                    form = await request.post()
            except TimeoutError:
                raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g}s")
            except ValueError as e:  # a malformed multipart body
                raise BadRequest(f"the body is not a multipart form: {e}") from None
            body, fmt = await asyncio.to_thread(transcription_body, form)
            self.check.check("chat", body)
            sampling = self._sampling(body)
            body["messages"] = await self._decode_media(body["messages"])
        except BadRequest as e:
            return self._invalid(e)
        run = self._start(body, "transcription", "tr", "messages", sampling, final)
        if isinstance(run, web.Response):
            return run
        try:
            if body.get("stream"):
                return await self._stream_transcript(request, run)
            events, last = await self._events(run)
            if last.kind == "error":
                return error_response(last.status, last.message, last.code)
            text = "".join(as_text(ev.payload) for ev in events)
            if fmt == "text":
                return web.Response(text=text, content_type="text/plain")
            return web.json_response({"text": text, "usage": _transcription_usage(last.payload)})
        finally:
            self.orch.abort(run)

    async def _stream_transcript(self, request: web.Request, run: Run) -> web.StreamResponse:
        """OpenAI's transcript stream: SSE `transcript.text.delta` events, then `transcript.text.done`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        text: list[str] = []
        try:
            while True:
                ev: Event = await run.events.get()
                if ev.kind == "output":
                    text.append(as_text(ev.payload))
                    await resp.write(_sse({"type": "transcript.text.delta", "delta": text[-1]}))
                    continue
                if ev.kind == "end":
                    await resp.write(_sse({"type": "transcript.text.done", "text": "".join(text),
                                           "usage": _transcription_usage(ev.payload)}))
                else:
                    await resp.write(_sse({"type": "error", "error": {"message": ev.message, "type": ev.code,
                                                                      "code": ev.status}}))
                break
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return resp

    async def _stream_speech(self, request: web.Request, run: Run, sse: bool) -> web.StreamResponse:
        """PCM as the audio stages produce it: raw bytes, or SSE speech.audio.delta events."""
        resp: web.StreamResponse | None = None
        seconds = 0.0
        try:
            while True:
                ev: Event = await run.events.get()
                if ev.kind == "error" and resp is None:
                    return error_response(ev.status, ev.message, ev.code)
                audio = None
                if ev.kind == "output":
                    audio = await off_loop(ev.payload, lambda: media.audio_of(ev.payload,
                                                                              self.limits.max_audio_seconds))
                    seconds += len(audio.pcm) / (2 * audio.channels * audio.sample_rate)
                    if seconds > self.limits.max_audio_seconds:
                        raise media.MediaError(f"more than the {self.limits.max_audio_seconds:g}s of audio "
                                               "the master streams for one request")
                if resp is None:
                    rate = audio.sample_rate if audio is not None else media.DEFAULT_SAMPLE_RATE
                    ctype = "text/event-stream" if sse else "audio/pcm"
                    resp = web.StreamResponse(headers={"Content-Type": ctype, "Cache-Control": "no-cache",
                                                       "X-Sample-Rate": str(rate)})
                    await resp.prepare(request)
                if audio is not None:
                    if sse:
                        event = {"type": "speech.audio.delta", "audio": base64.b64encode(audio.pcm).decode()}
                        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    else:
                        await resp.write(audio.pcm)
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


async def off_loop(payload: Any, fn):
    """fn() on the loop when the payload is small, in a worker thread when it is not."""
    if _nbytes(payload) < INLINE_BYTES:
        return fn()
    return await asyncio.to_thread(fn)


def _nbytes(value: Any, depth: int = 0) -> int:
    if isinstance(value, wire.Array):
        return len(value.data)
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return len(value)
    if depth < 8 and isinstance(value, dict):
        return sum(_nbytes(v, depth + 1) for v in value.values())
    if depth < 8 and isinstance(value, list):
        return sum(_nbytes(v, depth + 1) for v in value)
    return 8


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Reply:
    """How one chat or completion request wants its answer shaped."""

    def __init__(self, kind: str, token_ids: bool, audio: str | None):
        self.kind = kind
        self.token_ids = token_ids
        self.audio = audio  # None, "pcm16" or one of media.AUDIO_TYPES
        self.audio_id = f"audio_{uuid.uuid4().hex[:24]}"
        self.include_usage = False  # stream_options.include_usage: a last chunk with the usage


def _nth(sampling: dict[str, dict[str, Any]], entry: str, i: int) -> dict[str, dict[str, Any]]:
    """The sampling params of the i-th of n runs: one choice each, and a seeded entry stage seeded apart."""
    out = {stage: dict(params) for stage, params in sampling.items()}
    out[entry].pop("n", None)
    if isinstance(out[entry].get("seed"), int) and not isinstance(out[entry]["seed"], bool):
        out[entry]["seed"] += i
    return out


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "stages": {}}
    for u in usages:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += u[key]
        for stage, counts in u["stages"].items():
            mine = total["stages"].setdefault(stage, {"prompt_tokens": 0, "completion_tokens": 0})
            for key in counts:
                mine[key] += counts[key]
    return total


# Form fields of /v1/audio/transcriptions; OpenAI's others (timestamps, diarization, logprobs) are refused by name.
TRANSCRIPTION_FIELDS = ("file", "model", "prompt", "language", "temperature", "response_format", "stream", "timeout")
TRANSCRIPT_INSTRUCTION = "Transcribe the audio."
_AUDIO_MAGIC = ((b"RIFF", "wav"), (b"fLaC", "flac"), (b"OggS", "ogg"), (b"ID3", "mp3"))


def transcription_body(form: Any) -> tuple[dict[str, Any], str]:
    """A transcription form as the chat body it runs as, and its response_format (a worker thread's work:
    it base64-encodes the file)."""
    unknown = sorted({k for k in form.keys() if k not in TRANSCRIPTION_FIELDS})
    if unknown:
        raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(this endpoint takes {', '.join(TRANSCRIPTION_FIELDS)})")
    values: dict[str, str] = {}
    for key in TRANSCRIPTION_FIELDS[1:]:
        got = form.getall(key, [])
        if len(got) > 1:
            raise BadRequest(f"'{key}' is given {len(got)} times")
        if got:
            if not isinstance(got[0], str):
                raise BadRequest(f"'{key}' must be a form field, not a file")
            values[key] = got[0]
    files = form.getall("file", [])
    if len(files) != 1 or not hasattr(files[0], "file"):
        raise BadRequest("'file' is required: one audio file (wav, flac, mp3 or ogg) as a multipart file field")
    raw = files[0].file.read()
    fmt = next((f for magic, f in _AUDIO_MAGIC if raw.startswith(magic)), None)
    if fmt is None and len(raw) > 1 and raw[0] == 0xFF and raw[1] & 0xE0 == 0xE0:
        fmt = "mp3"  # an MPEG audio frame header without an ID3 tag
    if fmt is None:
        raise BadRequest(f"'file' ({str(files[0].filename)[:64]!r}) is not wav, flac, mp3 or ogg audio")
    response_format = values.get("response_format", "json")
    if response_format not in ("json", "text"):
        raise BadRequest(f"response_format {response_format[:32]!r} is not supported here; use json or text "
                         "(srt, vtt and verbose_json need timestamps, which the pipeline does not produce)")
    instruction = TRANSCRIPT_INSTRUCTION
    language = values.get("language")
    if language is not None:
        if not (2 <= len(language) <= 3 and language.isascii() and language.isalpha()):
            raise BadRequest(f"'language' must be an ISO-639-1 code such as 'en', not {language[:32]!r}")
        instruction = f"Transcribe the audio; its language: {language.lower()}."
    if values.get("prompt"):
        instruction += "\n" + values["prompt"]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt}},
        {"type": "text", "text": instruction}]}]}
    if "model" in values:
        body["model"] = values["model"]
    for key in ("temperature", "timeout"):
        if key in values:
            try:
                body[key] = float(values[key])
            except ValueError:
                body[key] = math.nan
            if not math.isfinite(body[key]):
                raise BadRequest(f"'{key}' must be a number")
    if "stream" in values:
        if values["stream"] not in ("true", "false"):
            raise BadRequest("'stream' must be true or false")
        body["stream"] = values["stream"] == "true"
    return body, response_format


def _transcription_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The run's token counts as OpenAI's transcription usage."""
    return {"type": "tokens", "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"]}


def _audio_format(body: dict[str, Any], kind: str) -> str | None:
    """Chat's audio format (None for a completion, whose `audio` names only a voice); checks `audio`."""
    audio = body.get("audio") or {}
    if not isinstance(audio, dict):
        raise BadRequest("'audio' must be an object {voice, format}" if kind == "chat" else
                         "'audio' must be an object {voice}")
    voice = audio.get("voice")
    if voice is not None and (not isinstance(voice, str) or not voice.strip()):
        raise BadRequest("audio.voice must be a non-empty string")
    if kind != "chat":
        if set(audio) - {"voice"}:
            raise BadRequest(f"a completion's 'audio' takes only 'voice' (its audio comes as the stage made it), "
                             f"not {', '.join(repr(k[:32]) for k in sorted(set(audio) - {'voice'}))}")
        return None
    fmt = audio.get("format") or "wav"
    if fmt not in (*media.AUDIO_TYPES, "pcm16"):
        raise BadRequest(f"audio.format {str(fmt)[:32]!r} is not supported here; use one of "
                         f"{', '.join((*media.AUDIO_TYPES, 'pcm16'))}")
    return fmt


def _token_ids(payload: Any) -> list[int]:
    if isinstance(payload, dict) and isinstance(payload.get("token_ids"), list):
        return payload["token_ids"]
    return []
