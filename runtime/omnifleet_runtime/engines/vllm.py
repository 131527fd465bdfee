"""The `llm` engine: a vLLM engine behind a stage, through vLLM's public API only.

What it uses, all of it exported by `vllm` itself, so the official CUDA build
and the CPU build (and neighbouring releases) serve alike:

- `vllm.AsyncEngineArgs(model=<stage model>, **engineArgs)` and
  `vllm.AsyncLLMEngine.from_engine_args(...)` (the public name of the async engine);
- `vllm.SamplingParams(**params)` with `output_kind=RequestOutputKind.DELTA`
  (outputs stream as deltas);
- `engine.generate(prompt, params, request_id)`, `engine.abort(request_id)`,
  `engine.get_tokenizer()`, `engine.get_num_unfinished_requests()`, `engine.shutdown()`;
- prompts as `vllm.inputs.tokens_input(...)` where it exists, else `TokensPrompt`;
- optionally a `vllm.v1.metrics.loggers.StatLoggerBase` (vLLM's documented hook for
  custom stat loggers) to read the scheduler's running and waiting counts.

engineArgs map one to one onto `AsyncEngineArgs` fields; a name that is not a
field fails the stage at start, naming it (and the closest field names).
`model` comes from the stage (`stages[].model`, default `spec.model`); `$VAR`
and `${VAR}` in it are expanded from the stage's environment, and a local path
(starting with `/`, `.` or `~`) must exist.

Inputs (one item per request in `whole` mode; the entry stage receives the
client's chat `messages` or completion `prompt`):

- a string: a text prompt (tokenized with the model's tokenizer, as vLLM does);
- a list of chat messages (`{"role", "content"}`): the chat template is applied
  here, once, with the generation prompt added; image and audio parts (as the
  master decodes them) go to the engine as vLLM's `multi_modal_data` (mm.py),
  for a multimodal model (the stage's `engineArgs` may set `limit_mm_per_prompt`);
- a list of ints: token ids;
- a dict with one of `prompt`, `messages`, `prompt_token_ids`, and optionally
  `sampling_params` (overrides for this item) and `chat_template_kwargs`
  (template variables; apply_chat_template's own arguments are refused).

Templating and tokenizing run in one worker thread of the engine, never on
the stage's event loop: a slow or hostile template then delays its own
request, not the heartbeats and every other request of the replica. (The
master refuses request-supplied templates unless the pipeline trusts them.)

Sampling params: the stage's `samplingParams`, overridden per request; any
`vllm.SamplingParams` field (an unknown one fails the request, naming it).
OpenAI spellings are accepted: `max_completion_tokens` for `max_tokens`, and
chat's `logprobs: true` with `top_logprobs: k`.

Output chunks (one per engine step, streamed):
`{"text": delta text, "token_ids": delta ids}`, plus `prompt_token_ids` in the
first chunk, `finish_reason` (and `stop_reason`) in the last, `index` when
`n > 1`, `logprobs` (`[[token_id, logprob], ...]` per token) when asked, and
`extra`: every tensor or array the model returned on the output objects
(as `wire.Array`s), for the next stage's input processor. With omnifleet's
hidden-states tap as vLLM's `worker_extension_cls` (engines/hidden.py), the
last chunk's `extra.hidden` holds the decoder's final hidden states of every
forwarded token, float32 `[prompt + generated - 1, hidden size]`.

Control RPCs: `ping`; `stats` (the engine's own counters: unfinished requests,
scheduler running/waiting); `generate` (`{"prompts": [...], "sampling_params":
{...}}`: the engine called directly, bypassing the pipeline; for checks and
benchmarks); `sleep`, `wake_up`, `reset_prefix_cache`, `start_profile`,
`stop_profile`, `is_sleeping` (passed to the engine).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import inspect
import logging
import os
import re
import time
import uuid
from typing import Any, AsyncIterator

from ..handoff import Threads
from ..schema import Stage
from . import hidden
from .base import BadInput, Engine, EngineRequest, EngineStartError
from .mm import split_media
from .tensors import is_tensor_like, to_wire

log = logging.getLogger("omnifleet.engine.vllm")

# Fields of the output objects that are not model outputs.
_PLAIN_FIELDS = {"index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
                 "lora_request", "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs",
                 "finished", "metrics", "encoder_prompt", "encoder_prompt_token_ids", "num_cached_tokens"}
_PASSTHROUGH_CONTROL = ("sleep", "wake_up", "reset_prefix_cache", "start_profile", "stop_profile", "is_sleeping")
# Arguments of apply_chat_template itself, which template kwargs must not override.
_TEMPLATE_ARGS = {"tokenize", "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                  "return_assistant_tokens_mask", "padding", "truncation", "max_length", "conversation",
                  "tokenizer_kwargs"}


def expand_model(stage: Stage) -> str:
    model = stage.model
    if not model:
        raise EngineStartError(f"stage {stage.name!r}: no model (set spec.model or stages[].model)")
    expanded = os.path.expanduser(os.path.expandvars(model))
    if m := re.search(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expanded):
        raise EngineStartError(f"stage {stage.name!r}: model {model!r} names ${m[1]}, which is not set "
                               f"in the stage's environment")
    if expanded.startswith(("/", ".", "~")) and not os.path.exists(expanded):
        raise EngineStartError(f"stage {stage.name!r}: model path {expanded} does not exist")
    return expanded


def check_engine_args(stage: Stage, fields: set[str], cls_name: str, version: str) -> None:
    """Fail with a message naming every engineArgs key that is not a field of the engine args class."""
    unknown = [k for k in stage.engine_args if k not in fields]
    if not unknown:
        return
    parts = []
    for k in unknown:
        close = difflib.get_close_matches(k, sorted(fields), n=2, cutoff=0.8)
        parts.append(f"{k!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    raise EngineStartError(
        f"stage {stage.name!r}: unknown vLLM engine arg{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(parts)} in engineArgs: not a field of {cls_name} (vLLM {version})")


class VllmEngine(Engine):
    max_concurrency = None  # vLLM batches and queues internally

    def __init__(self, stage: Stage, replica: str):
        self.stage = stage
        self.replica = replica
        self.engine: Any = None
        self.tokenizer: Any = None
        self.stats: dict[str, Any] = {"running": None, "waiting": None}
        self.active: dict[str, set[str]] = {}  # our request id -> vLLM request ids
        self.start_s = 0.0
        self.model = ""
        self.loras: dict[str, Any] = {}  # adapter name -> vLLM LoRARequest (stage.loras)
        self._vllm: Any = None
        # engineArgs name omnifleet's hidden-states tap as vLLM's worker extension (engines/hidden.py): each
        # request's last chunk carries the decoder's hidden states as extra["hidden"].
        self.tap = stage.engine_args.get("worker_extension_cls") == hidden.TAP
        # One thread: HF fast tokenizers are not safe to call from several threads at once.
        self._prompts = Threads(f"{stage.name}-tokenize", 1)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.model = expand_model(self.stage)
        import vllm
        from vllm import AsyncEngineArgs

        fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        check_engine_args(self.stage, fields - {"model"}, "vllm.AsyncEngineArgs", vllm.__version__)
        self._vllm = vllm
        args = {"disable_log_stats": False, **self.stage.engine_args, "model": self.model}
        if self.tap:
            # The tap hooks a submodule (compiled forwards skip hooks) and needs every prompt row forwarded.
            wrong = [f"{k}: {args.get(k)!r}" for k, want in (("enforce_eager", True), ("enable_prefix_caching", False))
                     if args.get(k) is not want]
            if wrong:
                raise EngineStartError(f"stage {self.stage.name!r}: worker_extension_cls {hidden.TAP} needs "
                                       f"engineArgs enforce_eager: true and enable_prefix_caching: false "
                                       f"(got {', '.join(wrong)})")
        if self.stage.loras:
            from vllm.lora.request import LoRARequest

            for i, a in enumerate(self.stage.loras):  # vLLM would find out at the first request for it
                if not os.path.isfile(os.path.join(a.path, "adapter_config.json")):
                    raise EngineStartError(f"stage {self.stage.name!r}: loras[{i}] ({a.name}): no adapter_config.json "
                                           f"in {a.path} (a PEFT adapter folder in the pod, e.g. in the model volume)")

            args = {"enable_lora": True, "max_loras": len(self.stage.loras), **args}
            self.loras = {a.name: LoRARequest(a.name, i + 1, a.path) for i, a in enumerate(self.stage.loras)}
        t = time.monotonic()
        try:
            engine_args = AsyncEngineArgs(**args)
            self.engine = self._create(vllm, engine_args)
        except EngineStartError:
            raise
        except Exception as e:
            raise EngineStartError(f"stage {self.stage.name!r}: vLLM could not start model {self.model}: "
                                   f"{type(e).__name__}: {e}") from e
        if self.tap:
            try:
                await self.engine.collective_rpc("omnifleet_hidden_install")
            except Exception as e:
                raise EngineStartError(f"stage {self.stage.name!r}: the hidden-states tap cannot hook model "
                                       f"{self.model}: {type(e).__name__}: {e}") from e
        self.start_s = time.monotonic() - t
        tok = self.engine.get_tokenizer()
        self.tokenizer = await tok if inspect.isawaitable(tok) else tok
        log.info("stage %s: vLLM %s engine for %s ready in %.1fs", self.stage.name, vllm.__version__, self.model,
                 self.start_s)

    def _create(self, vllm: Any, engine_args: Any) -> Any:
        factory = self._stat_logger_factory()
        if factory is not None:
            try:
                return vllm.AsyncLLMEngine.from_engine_args(engine_args, stat_loggers=[factory])
            except TypeError as e:
                if "stat_loggers" not in str(e):
                    raise
        return vllm.AsyncLLMEngine.from_engine_args(engine_args)

    def _stat_logger_factory(self) -> Any:
        try:
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError:
            return None
        stats = self.stats

        class SchedulerView(StatLoggerBase):
            """The engine core's view of its queues, as each step reports it."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    stats["running"] = scheduler_stats.num_running_reqs
                    stats["waiting"] = scheduler_stats.num_waiting_reqs

            def log_engine_initialized(self) -> None:
                pass

        return SchedulerView

    def dead(self) -> str | None:
        # AsyncLLM's public `errored`: its engine core process exited (vLLM's monitor thread saw it) or its
        # output handler stopped; every later call would raise EngineDeadError.
        if self.engine is not None and getattr(self.engine, "errored", False):
            return "the vLLM engine core is dead (its process exited or its output loop stopped)"
        return None

    async def shutdown(self) -> None:
        self._prompts.close()
        if self.engine is None:
            return
        try:
            if "timeout" in inspect.signature(self.engine.shutdown).parameters:
                self.engine.shutdown(timeout=30)  # vLLM's 5 s default ends the core with SIGKILL
            else:
                self.engine.shutdown()
        finally:
            self.engine = None

    # ------------------------------------------------------------ requests

    def prompt_of(self, item: Any) -> tuple[list[int], str | None, dict[str, Any], dict[str, Any] | None]:
        """(token ids, prompt text or None, per-item sampling overrides, multi_modal_data or None) of one item."""
        overrides: dict[str, Any] = {}
        template_kwargs: dict[str, Any] = {}
        if isinstance(item, dict):
            overrides = dict(item.get("sampling_params") or {})
            template_kwargs = dict(item.get("chat_template_kwargs") or {})
            if reserved := sorted(_TEMPLATE_ARGS & set(template_kwargs)):
                raise BadInput(f"stage {self.stage.name!r}: chat_template_kwargs may hold template variables "
                                 f"only, not {', '.join(reserved)}")
            keys = [k for k in ("prompt_token_ids", "messages", "prompt") if item.get(k) is not None]
            if not keys:
                raise BadInput(f"stage {self.stage.name!r}: an input dict needs one of prompt, messages or "
                                 f"prompt_token_ids (got keys {sorted(item)})")
            item = item[keys[0]]
        if isinstance(item, str):
            return list(self._tok().encode(item)), item, overrides, None
        if isinstance(item, (list, tuple)) and item and all(isinstance(m, dict) for m in item):
            messages, mm = split_media(list(item), self.stage.name, self.model or None)
            if mm is None:  # text only: content parts joined, for templates that take strings only
                messages = _text_messages(messages)
            text = self._tok().apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                   **template_kwargs)
            return list(self._tok().encode(text, add_special_tokens=False)), text, overrides, mm
        if isinstance(item, (list, tuple)) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in item):
            return list(item), None, overrides, None
        raise BadInput(f"stage {self.stage.name!r}: cannot make a prompt of {type(item).__name__} "
                         f"{_short(item)}: expected text, chat messages or token ids")

    def _tok(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"stage {self.stage.name!r}: the engine has no tokenizer (skip_tokenizer_init?); "
                             "send token ids")
        return self.tokenizer

    def sampling_params(self, params: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = dict(params)
        if "max_completion_tokens" in p:
            p.setdefault("max_tokens", p.pop("max_completion_tokens"))
        if isinstance(p.get("logprobs"), bool):  # the chat API's spelling
            p["logprobs"] = p.pop("top_logprobs", 0) if p["logprobs"] else None
        p.pop("top_logprobs", None)
        p.pop("output_kind", None)
        known = _sampling_fields(SamplingParams)
        unknown = sorted(k for k in p if k not in known)
        if unknown:
            raise BadInput(f"stage {self.stage.name!r}: unknown sampling parameter(s) {', '.join(unknown)} "
                             "(not fields of vllm.SamplingParams)")
        try:
            return SamplingParams(**{k: v for k, v in p.items() if v is not None},
                                  output_kind=RequestOutputKind.DELTA)
        except (TypeError, ValueError) as e:  # vLLM's own checks of the values
            raise BadInput(f"stage {self.stage.name!r}: bad sampling parameters: {e}") from e

    def _engine_prompt(self, ids: list[int], text: str | None, mm: dict[str, Any] | None = None) -> Any:
        if mm is not None:  # a prompt vLLM's multimodal processor expands (one placeholder per item)
            from vllm.inputs import TokensPrompt

            return TokensPrompt(prompt_token_ids=ids, multi_modal_data=mm,
                                **({"prompt": text} if text is not None else {}))
        try:
            from vllm.inputs import tokens_input
        except ImportError:
            from vllm.inputs import TokensPrompt

            return TokensPrompt(prompt_token_ids=ids, **({"prompt": text} if text is not None else {}))
        return tokens_input(ids, prompt=text)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        index = 0
        async for item in request.inputs:
            async for chunk in self.generate_one(item, request.sampling_params, f"{request.request_id}-{index}",
                                                 owner=request.request_id, lora=request.info.lora):
                yield chunk
            index += 1

    async def generate_one(self, item: Any, params: dict[str, Any], rid: str,
                           owner: str | None = None, lora: str = "") -> AsyncIterator[dict[str, Any]]:
        """lora: an adapter name; this stage runs it if it serves it, else its base model."""
        ids, text, overrides, mm = await self._prompts.run(self.prompt_of, item)
        sp = self.sampling_params({**params, **overrides})
        if self.tap and sp.n > 1:
            raise BadInput(f"stage {self.stage.name!r} puts hidden states on the wire: one sample per prompt (n 1)")
        vid = f"{rid}-{uuid.uuid4().hex[:8]}"
        owned = self.active.setdefault(owner or rid, set())
        owned.add(vid)
        first, taken, prompt_len, generated = True, False, 0, 0
        try:
            async for out in self.engine.generate(self._engine_prompt(ids, text, mm), sp, vid,
                                                  **({"lora_request": self.loras[lora]} if lora in self.loras else {})):
                chunks = self._chunks(out, sp, first)
                if self.tap:
                    prompt_len = len(out.prompt_token_ids or ()) or prompt_len
                    generated += sum(len(c.token_ids) for c in out.outputs)  # deltas
                    if out.finished:
                        taken = True
                        # every token but the last was forwarded (a step scheduled before the stop was known may
                        # have forwarded the last too: trimmed)
                        await self._attach_hidden(vid, prompt_len + generated - 1, chunks)
                for chunk in chunks:
                    yield chunk
                    first = False
                # vLLM hands over queued outputs without awaiting, and sends to ZMQ complete at once: a fast
                # stream would otherwise keep the loop from everything else (heartbeats, other requests).
                await asyncio.sleep(0)
        except Exception as e:
            if isinstance(e, _client_errors()):  # vLLM's own verdict: the request's fault (e.g. too many images)
                raise BadInput(f"stage {self.stage.name!r}: {e}") from None
            raise
        finally:
            owned.discard(vid)
            if not owned:
                self.active.pop(owner or rid, None)
            if self.tap and not taken and not self.engine.errored:
                try:
                    await self.engine.collective_rpc("omnifleet_hidden_drop", args=(vid,))
                except Exception as e:  # the tap bounds what it keeps; this only frees it sooner
                    log.warning("stage %s: could not drop the hidden states of %s: %s", self.stage.name, vid, e)

    async def _attach_hidden(self, vid: str, want: int, chunks: list[dict[str, Any]]) -> None:
        """The tap's first `want` rows of a finished request, on its last chunk."""
        import numpy as np

        taken = (await self.engine.collective_rpc("omnifleet_hidden_take", args=(vid,)))[0]
        if taken is None or taken[0][0] < want:
            raise RuntimeError(f"stage {self.stage.name!r}: the hidden-states tap holds "
                               f"{0 if taken is None else taken[0][0]} rows of request {vid}, not {want}")
        rows = np.frombuffer(taken[1], dtype=np.float32).reshape(taken[0])
        if not chunks:
            chunks.append({"text": "", "token_ids": []})
        chunks[-1].setdefault("extra", {})["hidden"] = to_wire(rows[:want])

    def _chunks(self, out: Any, sp: Any, first: bool) -> list[dict[str, Any]]:
        chunks = []
        for comp in out.outputs:
            chunk: dict[str, Any] = {"text": comp.text, "token_ids": list(comp.token_ids)}
            if first and out.prompt_token_ids is not None:
                chunk["prompt_token_ids"] = list(out.prompt_token_ids)
            if sp.n > 1:
                chunk["index"] = comp.index
            if comp.finish_reason is not None:
                chunk["finish_reason"] = comp.finish_reason
                if comp.stop_reason is not None:
                    chunk["stop_reason"] = comp.stop_reason
            if comp.logprobs:
                chunk["logprobs"] = [[[tid, lp.logprob] for tid, lp in pos.items()] for pos in comp.logprobs]
            extra = _extra_tensors(out) | _extra_tensors(comp)
            if extra:
                chunk["extra"] = extra
            if chunk["token_ids"] or chunk["text"] or len(chunk) > 2 or out.finished:
                chunks.append(chunk)
        return chunks

    async def abort(self, request_id: str) -> None:
        ids = self.active.pop(request_id, set())
        if ids and self.engine is not None:
            await self.engine.abort(list(ids))  # generate() aborts on cancel too; this makes sure

    # ------------------------------------------------------------ control

    async def control(self, method: str, args: dict[str, Any]) -> Any:
        if method == "ping":
            return {"pong": True, "stage": self.stage.name, "replica": self.replica, "pid": os.getpid(),
                    "engine": "vllm", "vllm": self._vllm.__version__, "model": self.model}
        if method == "stats":
            return {"unfinished": self.engine.get_num_unfinished_requests(), "running": self.stats["running"],
                    "waiting": self.stats["waiting"], "active": len(self.active), "engine_start_s": self.start_s}
        if method == "generate":
            return await self._direct(args)
        if method in _PASSTHROUGH_CONTROL:
            result = getattr(self.engine, method)(**args)
            result = await result if inspect.isawaitable(result) else result
            return result if isinstance(result, (bool, int, float, str, type(None))) else str(result)
        raise ValueError(f"unsupported control method {method!r} for an llm stage (ping, stats, generate, "
                         f"{', '.join(_PASSTHROUGH_CONTROL)})")

    async def _direct(self, args: dict[str, Any]) -> dict[str, Any]:
        """The engine called directly with each prompt (concurrently), bypassing the pipeline."""
        prompts = args.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("generate: args.prompts must be a non-empty list of inputs")
        params = dict(args.get("sampling_params") or {})
        lora = args.get("lora") or ""
        if lora and lora not in self.loras:
            raise ValueError(f"generate: stage {self.stage.name!r} serves no LoRA adapter {str(lora)[:64]!r} "
                             f"(it serves: {', '.join(self.loras) or 'none'})")

        async def one(i: int, item: Any) -> dict[str, Any]:
            text, ids, prompt_ids, first = [], [], None, None
            t0 = time.monotonic()
            async for chunk in self.generate_one(item, params, f"direct-{uuid.uuid4().hex[:8]}-{i}", lora=lora):
                if first is None and chunk["token_ids"]:
                    first = time.monotonic() - t0  # the engine's own time to first token
                text.append(chunk["text"])
                ids += chunk["token_ids"]
                prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
            return {"text": "".join(text), "token_ids": ids, "prompt_token_ids": prompt_ids, "first_token_s": first}

        t = time.monotonic()
        outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return {"outputs": outputs, "elapsed_s": time.monotonic() - t}


def _sampling_fields(cls: Any) -> set[str]:
    fields = getattr(cls, "__struct_fields__", None)  # msgspec.Struct (vLLM >= 0.6)
    if fields is None:
        fields = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    return set(fields)


def _client_errors() -> tuple[type[BaseException], ...]:
    """vLLM's exceptions that blame the request (vllm.exceptions.VLLMClientError, where it exists)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)


def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages whose content parts are all text (split_media checked them), joined into strings."""
    return [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]


def _extra_tensors(obj: Any) -> dict[str, Any]:
    """Tensors and arrays the model put on an output object (e.g. routed experts, multimodal outputs)."""
    extra = {}
    for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
        if name in _PLAIN_FIELDS or name.startswith("_") or value is None:
            continue
        if is_tensor_like(value):
            extra[name] = to_wire(value)
        elif isinstance(value, dict) and value and all(is_tensor_like(v) for v in value.values()):
            extra[name] = to_wire({str(k): v for k, v in value.items()})
    return extra


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
