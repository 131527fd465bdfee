"""The `vllm-omni` engine: one of vLLM-Omni's own stage engines behind an omnifleet stage.

The stage process runs with vLLM-Omni's environment (its image in production;
`python -m omnifleet_runtime.devsetup.vllm_omni_env` builds one here) and
omnifleet's runtime on PYTHONPATH.

One stage of a vLLM-Omni pipeline becomes one engine:
- The stage's place in its pipeline (`vllmOmni.pipeline`, `stageId`) is looked
  up in vLLM-Omni's pipeline registry. A one-stage copy of that stage (no
  upstream, its output final, no connector wiring) is registered as
  `omnifleet.<pipeline>.<stageId>` and started through vLLM-Omni's own entry
  point, `vllm_omni.AsyncOmni`, with a deploy file holding this stage's deploy
  settings (`engineArgs`, default sampling params): the stage engine core, its
  AR or generation worker, scheduler and model are vLLM-Omni's.
- vLLM-Omni's data plane between stages (its worker connector) is omnifleet's
  wire instead. A stage sends its token ids and every tensor its engine output
  carries (hidden states, codec codes, audio) as `wire.Array`s. The downstream
  stage runs on them the upstream stage's payload builder (its
  `custom_process_next_stage_input_func`, e.g. `thinker2talker_full_payload`)
  and its own input processor (`vllmOmni.inputProcessor`, e.g.
  `thinker2talker_token_only`), and gives its engine the payload as the
  request's `additional_information`, which vLLM-Omni's model runner puts where
  its connector would have: the model's intermediate buffer.
- Requests reach the stage engine core as vLLM-Omni's full pipeline would send
  them (`_hook_requests`): a downstream stage's as an engine-core request built
  from its tokens, and a stage that feeds another tagged so that its AR runner
  keeps the per-step payload (the thinker's hidden states) on the output.

Inputs of the entry stage: a string (text prompt), a list of ints (token ids),
chat messages (the model's chat template is applied; image and audio parts, as
the master decodes them, go to the engine as vLLM's `multi_modal_data`), or a dict with one of
`prompt`, `prompt_token_ids`, `messages`. A downstream stage takes its upstream
stage's output chunks (`inputMode: whole`).

Output: one chunk per request when the engine finishes it: `token_ids`,
`prompt_token_ids`, `text`, `finish_reason` and `extra` (every tensor of the
output, as arrays; an AR stage's hidden states as `hidden`, the prompt's and
every generated token's but the last); a stage whose final output is audio also
carries `audio` (float32 samples) and `sample_rate`.

Async-chunk mode (`vllmOmni.asyncChunk`, edges `inputMode: stream`): the stage
engines stream to each other as in vLLM-Omni's own pipeline, their connector
payloads crossing pods as output chunks (`_generate_chunked`); a final stage's
text and audio come out as they grow.

The request's voice (`voice`) goes into the entry stage's prompt as vLLM-Omni's
serving layer puts it; the thinker's payload builders carry it to the talker.

Not yet: fan-in from several upstream stages (refused at start; vLLM-Omni
0.30's registry has none), CFG companions' KV hand-over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import tempfile
import time
import types
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from .. import constants as C
from ..schema import Stage
from ..wire import Array, walk
from .base import BadInput, Engine, EngineRequest, EngineStartError, requested_voice
from .mm import split_media
from .tensors import is_tensor_like, to_tensor, to_wire
from .vllm import expand_model

log = logging.getLogger("omnifleet.engine.vllm_omni")

# Qwen2.5-Omni's and Qwen3-Omni's code2wav: 24 kHz.
DEFAULT_SAMPLE_RATE = 24000
# Engine args that describe the pipeline's wiring, which the stage's vllmOmni block and vLLM-Omni's
# registry already fix; the importer copies them into engineArgs for the record.
_WIRING = {"async_chunk", "session_mode", "inline_diffusion"}
# Async-chunk mode: the key of an output chunk that carries a connector payload to the next stage; how often
# the stage polls its engine's connector for the next one, and how long after its engine finished a request.
ASYNC_CHUNK = "vllm_omni_chunk"
ASYNC_CHUNK_POLL_S = 0.002
ASYNC_CHUNK_GRACE_S = 30.0
_FINISH_STATUS = {"stop": "FINISHED_STOPPED", "length": "FINISHED_LENGTH_CAPPED", "abort": "FINISHED_ABORTED"}

MISSING = (
    "stage {stage!r} is a vllm-omni stage, and this stage's python ({python}) cannot import vLLM-Omni ({error}): "
    "run it with vLLM-Omni's environment (its image, or the python that "
    "`python -m omnifleet_runtime.devsetup.vllm_omni_env --print-python` prints)"
)


def _load(ref: str) -> Any:
    module, _, attr = ref.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _speakers(model: str) -> set[str]:
    """The voices a model's config lists, lower case, as vLLM-Omni's serving layer reads them (its
    `get_supported_speakers_from_hf_config`, whose module imports its whole server); empty when it lists none."""
    from transformers import PretrainedConfig

    try:
        talker = PretrainedConfig.get_config_dict(model)[0].get("talker_config") or {}
    except (OSError, ValueError):  # no readable config.json: the engine's start says so
        return set()
    for key in ("speaker_id", "spk_id"):
        if isinstance(talker, dict) and isinstance(talker.get(key), dict) and talker[key]:
            return {str(name).lower() for name in talker[key]}
    return set()


class VllmOmniEngine(Engine):
    max_concurrency = None  # vLLM-Omni's scheduler batches and queues

    def __init__(self, stage: Stage, replica: str):
        self.stage = stage
        self.replica = replica
        self.spec = stage.vllm_omni
        self.omni: Any = None
        self.pipeline_stage: Any = None  # vLLM-Omni's StagePipelineConfig of this stage
        self.upstream_builder: Any = None  # the upstream stage's payload builder
        self.input_processor: Any = None
        self.tokenizer: Any = None
        self.model = ""
        self._dir: tempfile.TemporaryDirectory | None = None
        self._active: dict[str, set[str]] = {}  # our request id -> vLLM-Omni request ids
        self.async_chunk = bool(self.spec and (self.spec.async_chunk or stage.engine_args.get("async_chunk")))
        self._conn: Any = None  # async-chunk mode: vLLM-Omni's shared-memory connector to the stage engine
        self._engine_ids: dict[str, asyncio.Future] = {}  # async-chunk mode: our request id -> the engine's
        self.speakers: set[str] = set()  # the model's voices, lower case (none listed: any voice is taken)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        name = self.stage.name
        # What no vLLM-Omni install changes is refused first.
        if self.spec is None:
            raise EngineStartError(f"stage {name!r}: vllmOmni is required for vllm-omni stages")
        if self.async_chunk and self.spec.worker_type == "diffusion":
            raise EngineStartError(f"stage {name!r}: vLLM-Omni's async-chunk mode runs AR and generation stages "
                                   "here, not diffusion ones (no deploy file of vLLM-Omni 0.30 has one)")
        if len(self.stage.inputs) > 1:
            raise EngineStartError(f"stage {name!r}: a vllm-omni stage takes one upstream stage, "
                                   f"not {len(self.stage.inputs)}")
        try:
            import vllm_omni  # noqa: F401
        except Exception as e:  # ImportError, or a broken install
            import sys

            raise EngineStartError(MISSING.format(stage=name, python=sys.executable,
                                                  error=f"{type(e).__name__}: {e}")) from None
        self.model = expand_model(self.stage)
        self.speakers = _speakers(self.model)
        from vllm_omni.config.pipeline_registry import register_pipeline, resolve_pipeline_config

        pipeline = resolve_pipeline_config(self.spec.pipeline)
        if pipeline is None:  # a resolver that picks its variant from the model's config (Qwen3-Omni's)
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(self.model, trust_remote_code=bool(
                self.stage.engine_args.get("trust_remote_code")))
            pipeline = resolve_pipeline_config(self.spec.pipeline, hf_config)
        if pipeline is None:
            raise EngineStartError(f"stage {name!r}: vllmOmni.pipeline {self.spec.pipeline!r} is not a pipeline "
                                   "of this vLLM-Omni")
        by_id = {s.stage_id: s for s in pipeline.stages}
        mine = by_id.get(self.spec.stage_id)
        if mine is None:
            raise EngineStartError(f"stage {name!r}: vllmOmni.stageId {self.spec.stage_id} is not a stage of "
                                   f"pipeline {self.spec.pipeline!r} (its stages: {sorted(by_id)})")
        self.pipeline_stage = mine
        # Async-chunk mode: the stage engine makes and takes its chunks itself (its scheduler's connector), so
        # neither processor runs here; a producer's engine runs its async-chunk payload builder.
        produces = mine.async_chunk_process_next_stage_input_func if self.async_chunk else None
        if self.stage.inputs and mine.input_sources and not self.async_chunk:
            upstream = by_id[mine.input_sources[0]]
            if upstream.custom_process_next_stage_input_func:
                self.upstream_builder = _load(upstream.custom_process_next_stage_input_func)
        processor = self.spec.input_processor or mine.sync_process_input_func or mine.custom_process_input_func
        if self.stage.inputs and processor and not self.async_chunk:
            self.input_processor = _load(processor)
        key = f"omnifleet.{self.spec.pipeline}.{self.spec.stage_id}"
        single = dataclasses.replace(
            mine, stage_id=0, input_sources=(), final_output=True,
            final_output_type=mine.final_output_type or ("audio" if mine.engine_output_type == "audio" else "text"),
            custom_process_input_func=None, custom_process_next_stage_input_func=produces,
            async_chunk_process_next_stage_input_func=None, sync_process_input_func=None,
            **({"requires_full_payload_input": False}
               if "requires_full_payload_input" in {f.name for f in dataclasses.fields(mine)} else {}))
        register_pipeline(dataclasses.replace(pipeline, model_type=key, stages=(single,),
                                              default_deploy_config_name=None))
        pipe_fields = {f.name for f in dataclasses.fields(mine)}
        deploy_stage = {k: v for k, v in self.stage.engine_args.items() if k not in pipe_fields | _WIRING}
        deploy_stage.update(stage_id=0, devices=self.spec.devices or "0")
        if self.stage.sampling_params:
            deploy_stage["default_sampling_params"] = dict(self.stage.sampling_params)
        import yaml

        self._dir = tempfile.TemporaryDirectory(prefix=f"omnifleet-{name}-")
        deploy = Path(self._dir.name) / "deploy.yaml"
        deploy.write_text(yaml.safe_dump({"pipeline": key, "async_chunk": False, "stages": [deploy_stage]}))
        from vllm_omni import AsyncOmni

        timeout = self.stage.engine_start_timeout_seconds or C.ENGINE_START_TIMEOUT_S
        log.info("stage %s: starting vLLM-Omni stage %s/%d (%s, %s) on %s", name, self.spec.pipeline,
                 self.spec.stage_id, mine.model_stage, self.spec.worker_type, self.model)
        restore = self._async_engine_config() if self.async_chunk else None
        try:
            # On the event loop's thread, as vLLM's engine is made: AsyncOmni binds its output task to this loop.
            self.omni = AsyncOmni(model=self.model, deploy_config=str(deploy), stage_init_timeout=timeout,
                                  init_timeout=timeout + 60)
        except Exception as e:
            raise EngineStartError(f"stage {name!r}: vLLM-Omni stage engine failed to start: "
                                   f"{type(e).__name__}: {e}") from e
        finally:
            if restore is not None:
                restore()
        # A stage whose vLLM-Omni stage feeds another keeps its per-step payload for it (see _hook_requests).
        feeds = mine.custom_process_next_stage_input_func or produces
        self._hook_requests(max(by_id) if feeds else None)

    def _connector_extra(self) -> dict[str, Any]:
        """The settings of the stage's incoming connector in its deploy file (Qwen3-Omni's codec chunk sizes,
        which its talker's async-chunk builder reads from its connector); {} for an entry stage."""
        sc = self.spec.stage_config or {}
        connectors = sc.get("connectors") or {}
        for ref in ((sc.get("extras") or {}).get("input_connectors") or {}).values():
            spec = connectors.get(ref) if isinstance(ref, str) else ref
            if isinstance(spec, dict):
                return dict(spec.get("extra") or {})
        return {}

    def _async_engine_config(self) -> Any:
        """Make the one-stage engine an async-chunk stage of its real pipeline; returns the undo.

        vLLM-Omni turns async-chunk mode off for a one-stage pipeline and gives its
        stage id 0, whose scheduler never takes chunks. The stage's model config
        (made here, in the stage process, and handed to its engine core) gets
        what the full pipeline would give it: async-chunk mode, the stage's real id
        and a connector. The connector is vLLM-Omni's shared-memory one, whatever
        the deploy file names between hosts: it joins the engine core and this
        process only (one pod), and omnifleet's wire joins the pods; its settings
        are the deploy file's (`_connector_extra`)."""
        from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector
        from vllm_omni.engine.arg_utils import OmniEngineArgs

        sid = self.pipeline_stage.stage_id
        extra = {**self._connector_extra(), **({} if self.stage.inputs else {"role": "sender"})}
        connector = {"name": "SharedMemoryConnector", "extra": {**extra, "stage_id": sid}}
        self._conn = SharedMemoryConnector({**extra, "stage_id": sid})
        made = OmniEngineArgs.__dict__["create_model_config"]

        def create_model_config(args: Any) -> Any:
            cfg = made(args)
            cfg.async_chunk, cfg.stage_id, cfg.stage_connector_config = True, sid, connector
            return cfg

        OmniEngineArgs.create_model_config = create_model_config
        return lambda: setattr(OmniEngineArgs, "create_model_config", made)

    def _hook_requests(self, final_stage_id: int | None) -> None:
        """Shape each request as vLLM-Omni's full pipeline would have it reach this stage's engine core.

        The hook is the engine's `_build_add_request_message`, the one place that
        knows the request id AsyncOmni makes unique and the sampling params.

        - A downstream stage's prompt becomes an engine-core request built from
          its tokens, as vLLM-Omni's orchestrator builds a downstream stage's
          (`build_engine_core_request_from_tokens`): vLLM's stage-0 input
          processor, which a plain prompt would go through, refuses a generation
          stage such as code2wav ("This model does not support generation").
        - With `final_stage_id`: vLLM-Omni's AR model runner puts its per-step
          payload (e.g. the thinker's hidden states) on a request's output only
          when the request's `omni_final_stage_id` (in its additional
          information) is past stage 0. Its engine tags each request with the
          final stage of *its* pipeline, 0 for this one-stage copy, so the
          payload would be dropped; requests are tagged with the final stage of
          the real pipeline instead, as there. The orchestrator keeps routing by
          the message's own final stage (0), so nothing is forwarded anywhere.
        """
        from vllm.v1.engine import EngineCoreRequest
        from vllm_omni.engine.async_engine_utils import apply_omni_final_stage_metadata
        from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

        engine = self.omni.engine
        build = engine._build_add_request_message
        downstream = bool(self.stage.inputs)

        def build_hooked(*, request_id: str, prompt: Any, sampling_params_list: Any = None, **kwargs: Any) -> Any:
            # The id AsyncOmni made unique (ours and a suffix) names the request's async chunks.
            named = next((f for rid, f in self._engine_ids.items()
                          if request_id == rid or request_id.startswith(rid + "-")), None)
            if named is not None and not named.done():
                named.set_result(request_id)
            if downstream and isinstance(prompt, dict):
                prompt = build_engine_core_request_from_tokens(
                    request_id=request_id, prompt=prompt, params=sampling_params_list[0],
                    model_config=engine.stage_vllm_configs[0].model_config)
                prompt.external_req_id = request_id
            msg = build(request_id=request_id, prompt=prompt, sampling_params_list=sampling_params_list, **kwargs)
            if final_stage_id is not None and isinstance(msg.prompt, EngineCoreRequest):
                msg.prompt = apply_omni_final_stage_metadata(msg.prompt, final_stage_id)
            return msg

        engine._build_add_request_message = build_hooked

    def dead(self) -> str | None:
        if self.omni is not None and getattr(self.omni, "errored", False):
            return "the vLLM-Omni stage engine is dead (its orchestrator or engine core stopped)"
        return None

    async def shutdown(self) -> None:
        if self.omni is not None:
            await asyncio.to_thread(self.omni.shutdown)
            self.omni = None
        if self._dir is not None:
            self._dir.cleanup()

    async def abort(self, request_id: str) -> None:
        if self.omni is not None:
            for rid in self._active.pop(request_id, ()):
                await self.omni.abort(rid)

    # ------------------------------------------------------------ requests

    def sampling_params(self, params: dict[str, Any]) -> Any:
        from vllm import SamplingParams

        p = {k: v for k, v in params.items() if v is not None}
        if "max_completion_tokens" in p:
            p["max_tokens"] = p.pop("max_completion_tokens")
        fields = set(SamplingParams.__struct_fields__) if hasattr(SamplingParams, "__struct_fields__") else None
        if fields is not None and (unknown := sorted(set(p) - fields)):
            raise BadInput(f"stage {self.stage.name!r}: unknown sampling parameter(s) {', '.join(unknown)}")
        try:
            return SamplingParams(**p)
        except (TypeError, ValueError) as e:
            raise BadInput(f"stage {self.stage.name!r}: bad sampling parameters: {e}") from None

    def voice(self, info: Any) -> str | None:
        """The request's voice (chat's `audio.voice`, speech's `voice`), as vLLM-Omni's serving layer takes it:
        lower case, one of the model's speakers where its config lists them (Qwen3-Omni's
        `talker_config.speaker_id`). The entry stage's prompt carries it (`additional_information.speaker`),
        where the thinker's payload builders read it for the talker."""
        voice = requested_voice(info)
        if voice is None:
            return None
        if not isinstance(voice, str) or not voice.strip():
            raise BadInput(f"stage {self.stage.name!r}: the voice must be a non-empty string")
        name = voice.lower().strip()
        if self.speakers and name not in self.speakers:
            raise BadInput(f"stage {self.stage.name!r}: unknown voice {voice[:64]!r} (this model speaks as "
                           f"{', '.join(sorted(self.speakers))})")
        return name

    def entry_prompt_of(self, item: Any, rid: str, voice: str | None = None) -> dict[str, Any]:
        prompt = self._entry_prompt(item)
        if voice is not None:
            prompt["additional_information"] = {"speaker": [voice]}
        return prompt

    def _entry_prompt(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict) and "sampling_params" in item:
            item = {k: v for k, v in item.items() if k != "sampling_params"}
        if isinstance(item, str):
            return {"prompt_token_ids": self._encode(item)}
        if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            return {"prompt_token_ids": list(item)}
        if isinstance(item, list) and all(isinstance(m, dict) and "role" in m for m in item):
            return self._chat(item)
        if isinstance(item, dict):
            if isinstance(item.get("prompt_token_ids"), list):
                return {"prompt_token_ids": [int(t) for t in item["prompt_token_ids"]]}
            if isinstance(item.get("prompt"), str):
                return {"prompt_token_ids": self._encode(item["prompt"])}
            if isinstance(item.get("messages"), list):
                return self._chat(item["messages"])
        raise BadInput(f"stage {self.stage.name!r}: input must be a prompt string, token ids, chat messages or a "
                       f"dict with prompt, prompt_token_ids or messages; got {type(item).__name__}")

    def _tok(self) -> Any:
        # Prompts reach the stage engine as token ids (its stage-0 input path renders tokens only).
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self.tokenizer

    def _encode(self, text: str) -> list[int]:
        return list(self._tok().encode(text))

    def _chat(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Chat messages -> token ids through the model's chat template; their media as multi_modal_data."""
        rendered, mm = split_media(messages, self.stage.name, self.model or None)
        ids = self._tok().apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (a mapping, not a dict) here.
        prompt: dict[str, Any] = {"prompt_token_ids": [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys")
                                                                        else ids)]}
        if mm is not None:
            prompt["multi_modal_data"] = mm
        return prompt

    def downstream_prompt(self, item: Any, rid: str, voice: str | None = None) -> dict[str, Any]:
        """The upstream stage's output chunks -> this stage's prompt, through vLLM-Omni's own processors, which
        see the request's voice where the upstream stage's engine request would carry it."""
        chunks = item if isinstance(item, list) else [item]
        if not chunks or not all(isinstance(c, dict) for c in chunks):
            raise BadInput(f"stage {self.stage.name!r}: upstream output must be the chunks of a vllm-omni stage")
        last = chunks[-1]
        prompt_ids = [int(t) for t in last.get("prompt_token_ids") or []]
        out_ids = [int(t) for c in chunks for t in c.get("token_ids") or []]
        extra = {k: to_tensor(v) if isinstance(v, Array) else v for k, v in (last.get("extra") or {}).items()}
        finish = last.get("finish_reason")
        completion = types.SimpleNamespace(token_ids=out_ids, cumulative_token_ids=out_ids, text=last.get("text", ""),
                                           finish_reason=finish, multimodal_output=extra)
        source = types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt_ids, outputs=[completion],
                                       finished=True, multimodal_output=extra)
        spoken = {"speaker": [voice]} if voice is not None else None
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids, **({"additional_information": spoken}
                                                                     if spoken else {})}
        if self.input_processor is not None:
            made = self.input_processor([source], prompt, False)
            if not made:
                raise BadInput(f"stage {self.stage.name!r}: the upstream stage produced nothing this stage can take")
            prompt = dict(made[0])
        else:
            prompt = {"prompt_token_ids": out_ids}
        if self.upstream_builder is not None:
            from vllm_omni.data_entry_keys import serialize_payload

            request = types.SimpleNamespace(
                request_id=rid, prompt_token_ids=prompt_ids, output_token_ids=out_ids,
                all_token_ids=prompt_ids + out_ids,
                status=types.SimpleNamespace(name=_FINISH_STATUS.get(finish, "")),
                additional_information=serialize_payload(spoken) if spoken else None)
            # The builder's transfer manager stands for the upstream stage's; what builders read of it is the
            # model config (Qwen3-Omni's, the thinker layer the talker takes), the same checkpoint's as here.
            config = self.omni.engine.stage_vllm_configs[0].model_config
            manager = types.SimpleNamespace(model_config=config, _get_model_config=lambda: config)
            payload = self.upstream_builder(manager, extra, request)
            if payload is None:
                raise BadInput(f"stage {self.stage.name!r}: the upstream payload builder made no payload "
                               "(see the stage log)")
            prompt["additional_information"] = payload
            # As there, only for a stage that waits for its upstream's full payload.
            if isinstance(payload, dict) and getattr(self.pipeline_stage, "requires_full_payload_input", False):
                self._deliver(prompt, payload)
        return prompt

    def _deliver(self, prompt: dict[str, Any], payload: dict[str, Any]) -> None:
        """What vLLM-Omni's scheduler does to a downstream request when its connector delivers the upstream
        stage's full payload (`OmniSchedulingCoordinator.update_request_metadata`), done here before the
        request is sent: a prompt length the payload names replaces the placeholder's; a generation stage's
        prompt becomes the payload's codec codes (Qwen3-Omni's code2wav reads its codes from its prompt)."""
        from vllm_omni.core.sched.omni_scheduling_coordinator import OmniSchedulingCoordinator
        from vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport import (
            _OmniConnectorPayloadTransportMixin as Transport)

        meta = Transport._extract_scheduling_metadata(payload)
        length = meta.get("next_stage_prompt_len")
        if isinstance(length, int) and length > 0:
            prompt["prompt_token_ids"] = [0] * length
        if self.spec.worker_type != "ar":
            codes = OmniSchedulingCoordinator._flatten_prompt_token_ids(meta.get("code_predictor_codes"))
            if codes:
                prompt["prompt_token_ids"] = codes

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        if self.async_chunk:
            async for chunk in self._generate_chunked(request):
                yield chunk
            return
        params = self.sampling_params(request.sampling_params)
        voice = self.voice(request.info)
        n = 0
        async for item in request.inputs:
            rid = f"{request.request_id}-{n}-{uuid.uuid4().hex[:8]}"
            n += 1
            # Templates, tokenizers and payload builders run off the event loop (heartbeats keep going).
            prompt = await asyncio.to_thread(self.downstream_prompt if self.stage.inputs else self.entry_prompt_of,
                                             item, rid, voice)
            self._active.setdefault(request.request_id, set()).add(rid)
            last = None
            try:
                async for out in self.omni.generate(prompt, request_id=rid, sampling_params_list=[params]):
                    last = out
            finally:
                self._active.get(request.request_id, set()).discard(rid)
            if last is None:
                raise RuntimeError(f"stage {self.stage.name!r}: vLLM-Omni returned no output")
            yield self._chunk(last)
        self._active.pop(request.request_id, None)

    def for_master(self, value: Any) -> Any:
        return None if isinstance(value, dict) and ASYNC_CHUNK in value else value

    async def _generate_chunked(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Async-chunk mode, as vLLM-Omni's orchestrator and connectors run it, across pods.

        - An entry stage's engine gets the prompt at once. A downstream stage's gets
          its request when the first upstream chunk arrives, with the placeholder
          prompt vLLM-Omni's orchestrator gives it (its length from the entry
          stage's expanded prompt, which every chunk carries on).
        - Upstream chunks go, in order, under the keys the engine's scheduler polls,
          into the connector it reads (`_async_engine_config`); it holds the
          request until each arrives (the talker takes one thinker token a step).
        - A producer's engine runs its async-chunk builder every step and puts the
          payloads under its own keys; they are taken here in order until the
          one marked finished and sent on, one output chunk each (`ASYNC_CHUNK`:
          the payload as arrays, the chunk's index, the entry stage's prompt).
        - The engine's own outputs, when the stage's output is final: text and token
          ids, or audio, as they grow (code2wav's audio chunk by chunk).
        The master gets the final outputs only (`for_master`)."""
        params = self.sampling_params(request.sampling_params)
        voice = self.voice(request.info)  # the entry stage's; the thinker's chunks carry it on
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        sid = self.pipeline_stage.stage_id
        queue: asyncio.Queue = asyncio.Queue()
        prompt_made: asyncio.Future = asyncio.get_running_loop().create_future()
        entry_ids: asyncio.Future = asyncio.get_running_loop().create_future()  # the entry stage's prompt
        engine_done = asyncio.Event()
        engine_id = self._engine_ids[rid] = asyncio.get_running_loop().create_future()
        put: list[str] = []  # the keys of the upstream chunks handed to the engine

        async def run_engine() -> None:
            prompt = await prompt_made
            self._active.setdefault(request.request_id, set()).add(rid)
            shown = {"tokens": 0, "text": 0, "audio": 0}
            try:
                async for out in self.omni.generate(prompt, request_id=rid, sampling_params_list=[params]):
                    if not entry_ids.done():
                        entry_ids.set_result([int(t) for t in getattr(out, "prompt_token_ids", None) or []])
                    if self.stage.final_output != "none" and (chunk := self._grown(out, shown)) is not None:
                        await queue.put(chunk)
            finally:
                self._active.get(request.request_id, set()).discard(rid)
                engine_done.set()

        async def take_inputs() -> None:
            n = 0
            async for item in request.inputs:
                if not self.stage.inputs:
                    prompt_made.set_result(await asyncio.to_thread(self.entry_prompt_of, item, rid, voice))
                    continue
                for c in item if isinstance(item, list) else [item]:
                    carried = c.get(ASYNC_CHUNK) if isinstance(c, dict) else None
                    if not isinstance(carried, dict):
                        continue  # the upstream stage's own text or audio
                    if n == 0:
                        ids = [int(t) for t in carried.get("prompt_token_ids") or []]
                        entry_ids.set_result(ids)
                        prompt_made.set_result({"prompt_token_ids": [0] * self._placeholder_len(ids)})
                    payload = walk(carried.get("payload"), lambda v: to_tensor(v) if isinstance(v, Array) else v)
                    key = f"{await engine_id}_{sid - 1}_{n}"
                    put.append(key)
                    ok, _, _ = await asyncio.to_thread(self._conn.put, str(sid - 1), str(sid), key, payload)
                    if not ok:
                        raise RuntimeError(f"stage {self.stage.name!r}: chunk {n} could not be handed to its engine "
                                           "(vLLM-Omni's shared-memory connector; see the stage log)")
                    n += 1
            if not prompt_made.done():
                raise BadInput(f"stage {self.stage.name!r}: the upstream stage sent no async-chunk payload")

        async def take_chunks() -> None:
            ids, eid = await entry_ids, await engine_id
            n, quiet_since = 0, None
            while True:
                got = await asyncio.to_thread(self._conn.get, str(sid), str(sid + 1), f"{eid}_{sid}_{n}")
                if got is None:
                    if engine_done.is_set():
                        quiet_since = quiet_since or time.monotonic()
                        if time.monotonic() - quiet_since > ASYNC_CHUNK_GRACE_S:
                            raise RuntimeError(f"stage {self.stage.name!r}: the engine finished request {rid} "
                                               f"without its last async chunk (after chunk {n - 1})")
                    await asyncio.sleep(ASYNC_CHUNK_POLL_S)
                    continue
                payload = got[0]
                await queue.put({"token_ids": [], "text": "", ASYNC_CHUNK: {
                    "index": n, "prompt_token_ids": ids, "payload": to_wire(payload)}})
                n += 1
                meta = payload.get("meta") if isinstance(payload, dict) else None
                finished = meta.get("finished") if isinstance(meta, dict) else None
                if finished is not None and bool(finished.item() if is_tensor_like(finished) else finished):
                    return

        tasks = [asyncio.ensure_future(run_engine()), asyncio.ensure_future(take_inputs())]
        if self.pipeline_stage.async_chunk_process_next_stage_input_func:
            tasks.append(asyncio.ensure_future(take_chunks()))
        ended = False  # every task ran to its end: the engine's own chunks were taken up to its finished one
        try:
            while True:
                if queue.empty() and all(t.done() for t in tasks):
                    for t in tasks:
                        t.result()
                    ended = True
                    break
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait([get, *(t for t in tasks if not t.done())], return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    continue
                get.cancel()
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()
        finally:
            for t in tasks:
                t.cancel()
            self._active.pop(request.request_id, None)
            self._engine_ids.pop(rid, None)
            if prompt_made.done() and not engine_done.is_set():  # failed or aborted here: the engine lets go too
                asyncio.ensure_future(self.omni.abort(rid))
            # Chunks nobody will read now: upstream ones the engine did not take (it may end first, at its
            # max_tokens), and, when the request did not run to its end, whatever the engine made.
            if put or (engine_id.done() and not ended):
                await asyncio.to_thread(self._sweep, put, None if ended else engine_id.result())

    def _sweep(self, keys: list[str], engine_id: str | None) -> None:
        """Remove a request's async chunks left in shared memory: `keys`, and with `engine_id` every one
        whose key begins with it (a listing of /dev/shm, for a request that did not run to its end)."""
        import os

        for key in keys:
            self._conn.cleanup(key)  # an unlink that finds nothing when the engine took the chunk
        try:
            names = os.listdir("/dev/shm") if engine_id else []
        except OSError:
            return
        for name in names:
            if name.startswith(f"{engine_id}_"):
                self._conn.cleanup(name)

    def _placeholder_len(self, entry_ids: list[int]) -> int:
        """The placeholder prompt's length vLLM-Omni's orchestrator gives a downstream async-chunk stage."""
        from vllm_omni.distributed.omni_connectors.adapter import compute_talker_prompt_ids_length

        try:
            n = max(1, compute_talker_prompt_ids_length(entry_ids))
        except Exception:
            n = max(1, len(entry_ids))
        hf = getattr(self.omni.engine.stage_vllm_configs[0].model_config, "hf_config", None)
        prewarm = getattr(hf, "async_chunk_prewarm_prompt_len", None)
        return int(prewarm) if prewarm is not None and int(prewarm) > 1 else n

    def _grown(self, out: Any, shown: dict[str, int]) -> dict[str, Any] | None:
        """What a cumulative engine output adds since the last one: token ids and text, or audio samples."""
        chunk = self._chunk(out, whole=False)
        ids, text = chunk["token_ids"], chunk["text"]
        grown: dict[str, Any] = {"token_ids": ids[shown["tokens"]:], "text": text[shown["text"]:],
                                 "finish_reason": chunk["finish_reason"]}
        if not shown["tokens"]:
            grown["prompt_token_ids"] = chunk["prompt_token_ids"]
        shown["tokens"], shown["text"] = len(ids), len(text)
        if "audio" in chunk:
            audio = chunk["audio"]
            if audio.numel() <= shown["audio"] and chunk["finish_reason"] is None:
                return None
            grown["audio"], grown["sample_rate"] = to_wire(audio[shown["audio"]:]), chunk["sample_rate"]
            shown["audio"] = audio.numel()
        elif not grown["token_ids"] and not grown["text"] and chunk["finish_reason"] is None:
            return None
        return grown

    def _restore_producer_key(self, tensors: dict[str, Any]) -> None:
        """Name an AR stage's per-step payload as its producer did: `hidden`.

        vLLM-Omni's AR runner emits each step's hidden states as `hidden`; its
        worker connector hands the next stage's payload builder (e.g.
        `thinker2talker_full_payload`) the steps concatenated under that name. Its
        output processor, on the client path this engine reads, files the same
        concatenation under the stage's output modality instead (`latent` for
        `engine_output_type: latent`). The wire carries it as `hidden`, what the
        builder reads.
        """
        if self.spec.worker_type != "ar" or "hidden" in tensors or self.pipeline_stage is None:
            return
        from vllm_omni.outputs.output_modality import OutputModality
        from vllm_omni.outputs.output_processor import _modality_to_type_string

        modality = _modality_to_type_string(OutputModality.from_string(self.pipeline_stage.engine_output_type))
        if modality not in ("text", "audio", "image") and modality in tensors:
            tensors["hidden"] = tensors.pop(modality)

    def _chunk(self, out: Any, whole: bool = True) -> dict[str, Any]:
        """The output chunk of an engine output; `whole=False` (async-chunk mode): without the tensors, the
        audio as a tensor."""
        audio_out = getattr(out, "final_output_type", None) == "audio" or self.stage.final_output == "audio"
        completion = out.outputs[0] if getattr(out, "outputs", None) else None
        ro = getattr(out, "request_output", None)
        if completion is None and ro is not None and getattr(ro, "outputs", None):
            completion = ro.outputs[0]
        from vllm_omni.data_entry_keys import flatten_payload

        tensors: dict[str, Any] = {}
        for holder in (completion, ro, out) if whole or audio_out else ():
            mm = getattr(holder, "multimodal_output", None) if holder is not None else None
            if hasattr(mm, "tensors") and hasattr(mm, "metadata"):
                mm = {**mm.metadata, **mm.tensors}
            if isinstance(mm, dict):
                # vLLM-Omni's output processor nests the model runner's dotted keys (`hidden_states.layer_1`
                # under `hidden_states.layers`); payload builders read them flat, as the runner emits them.
                mm = flatten_payload(mm)
                for k, v in mm.items():
                    if is_tensor_like(v) and k not in tensors:
                        tensors[k] = v
                    elif isinstance(v, list) and v and all(is_tensor_like(x) for x in v) and k not in tensors:
                        import torch

                        tensors[k] = torch.cat([x.reshape(-1) if x.dim() <= 1 else x for x in v])
        self._restore_producer_key(tensors)
        chunk: dict[str, Any] = {
            "token_ids": [int(t) for t in (completion.token_ids if completion is not None else [])],
            "prompt_token_ids": [int(t) for t in (getattr(out, "prompt_token_ids", None)
                                                  or getattr(ro, "prompt_token_ids", None) or [])],
            "text": (getattr(completion, "text", "") or "") if completion is not None else "",
            "finish_reason": getattr(completion, "finish_reason", None) if completion is not None else None,
        }
        if whole:
            chunk["extra"] = to_wire(tensors)
        if audio_out:
            audio = tensors.get("audio")
            if audio is None and not whole:  # a streamed output that adds no audio (its last, say)
                import torch

                audio = torch.zeros(0)
            if audio is None:
                raise RuntimeError(f"stage {self.stage.name!r}: vLLM-Omni's output has no audio "
                                   f"(its tensors: {sorted(tensors)})")
            sr = tensors.get("sr")
            audio = audio.detach().to("cpu").float().reshape(-1)
            chunk["audio"] = to_wire(audio) if whole else audio
            chunk["sample_rate"] = int(sr.reshape(-1)[0].item()) if is_tensor_like(sr) else DEFAULT_SAMPLE_RATE
        return chunk

