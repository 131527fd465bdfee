"""What a request to the master's API may carry: the known keys of each body, their types, and the bounds.

Every check raises BadRequest naming the field, which the API answers with
400: a wrong type or an oversized value never reaches a stage, and never
becomes a 500. Only the keys listed here travel to the stages. Values that
the stages read as they are (a completion's `prompt`, `stage_sampling_params`)
are any JSON within the bounds: nesting depth, integers msgpack can carry,
and `max_prompt_chars`. A request-supplied chat template (`chat_template`
anywhere in the body) runs code in the stage that applies it, so it is
refused unless the pipeline trusts request templates.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .schema import ApiLimits

# Top-level fields that override the entry stage's sampling params.
OPENAI_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "seed", "stop",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "logprobs", "top_logprobs",
    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
)
# negative_prompt: the unconditional branch of classifier-free guidance (a stage's promptExpand runs it).
_COMMON = ("model", "user", "stage_sampling_params", "timeout", "metadata")
_GENERATE = _COMMON + OPENAI_SAMPLING + ("stream", "stream_options", "return_token_ids", "logit_bias", "negative_prompt")
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "chat": frozenset(_GENERATE + (
        "messages", "modalities", "audio", "response_format", "tools", "tool_choice", "parallel_tool_calls",
        "chat_template", "chat_template_kwargs", "store", "service_tier", "reasoning_effort")),
    # `modalities` as on chat (an extension): a completion's non-text outputs come in the choice's `omni` field;
    # `audio` takes only chat's `voice` there (the samples come as the stage made them).
    "completion": frozenset(_GENERATE + ("prompt", "echo", "best_of", "suffix", "modalities", "audio")),
    "image": frozenset(_COMMON + ("prompt", "n", "size", "seed", "response_format", "quality", "style",
                                  "negative_prompt")),
    "speech": frozenset(_COMMON + ("input", "voice", "response_format", "speed", "instructions", "stream_format")),
}
# chat_template_kwargs keys that are arguments of apply_chat_template itself, not template variables.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "conversation",
    "tokenizer_kwargs",
})
MAX_DEPTH = 32
MEDIA_PART_TYPES = ("image_url", "input_audio", "video_url")
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 64 - 1  # what msgpack carries
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "max_tokens", "max_completion_tokens", "n", "top_logprobs", "min_tokens")
_BOOLS = ("stream", "return_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "echo")


class BadRequest(ValueError):
    """A request the API refuses with 400; the message names the field."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (no NaN or Infinity, bounded nesting)."""

    def no_constant(name: str) -> Any:
        raise BadRequest(f"the body is not valid JSON: {name} is not a JSON number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise BadRequest(f"the body holds a number out of range: {text[:32]}")
        return value

    try:
        body = json.loads(raw, parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except UnicodeDecodeError:
        raise BadRequest("the body is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def json_size(value: Any, field: str, depth: int = 0) -> int:
    """Characters of the strings in value plus one per other leaf; refuses deep nesting and huge integers."""
    if depth > MAX_DEPTH:
        raise BadRequest(f"{field!r} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return 1
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise BadRequest(f"{field!r} holds an integer out of range ({_INT_MIN} to {_INT_MAX})")
        return 1
    if isinstance(value, list):
        return 1 + sum(json_size(v, field, depth + 1) for v in value)
    if isinstance(value, dict):
        return 1 + sum(len(k) + json_size(v, field, depth + 1) for k, v in value.items())
    raise BadRequest(f"{field!r} holds a value JSON cannot carry")


def _key_path(value: Any, key: str, path: str = "", depth: int = 0) -> str | None:
    """The dotted path of the first dict key named key in value, or None."""
    if depth > MAX_DEPTH:
        return None  # json_size refuses it
    if isinstance(value, dict):
        if key in value:
            return f"{path}{key}"
        items = ((f"{path}{k}.", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path.rstrip('.')}[{i}].", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        if (found := _key_path(v, key, sub, depth + 1)) is not None:
            return found
    return None


def _int(body: dict[str, Any], key: str, lo: int, hi: int, field: str | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    name = field or key
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name!r} must be an integer")
    if not lo <= value <= hi:
        raise BadRequest(f"{name!r} must be from {lo} to {hi}, got {value}")
    return value


class RequestCheck:
    """The checks of one pipeline's limits; each method raises BadRequest or returns normally."""

    def __init__(self, limits: ApiLimits, stages: list[str], trust_chat_template: bool, companions: bool = False):
        self.limits = limits
        self.stages = set(stages)
        self.trust_chat_template = trust_chat_template
        self.companions = companions  # a stage expands prompts (promptExpand): negative_prompt has a reader

    def check(self, kind: str, body: dict[str, Any]) -> None:
        unknown = sorted(k for k in body if k not in KNOWN_KEYS[kind])
        if unknown:
            raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             f"(per-stage parameters go in stage_sampling_params)")
        if not self.trust_chat_template and (where := _key_path(body, "chat_template")) is not None:
            raise BadRequest(f"{where!r}: this pipeline does not accept chat templates from requests "
                             "(they run code in the stages; spec.master.trustRequestChatTemplate allows them)")
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise BadRequest("'model' must be a string")
        self._sampling(body, "")
        self._stage_sampling(body.get("stage_sampling_params"))
        negative = body.get("negative_prompt")
        if negative is not None:
            if not self.companions:
                raise BadRequest("'negative_prompt': no stage of this pipeline runs guidance companions "
                                 "(a stage's promptExpand, e.g. omnifleet_runtime.processors:negative_prompt)")
            if not isinstance(negative, str) or not negative:
                raise BadRequest("'negative_prompt' must be a non-empty string")
            self._bounded("negative_prompt", len(negative))
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or any(
                k != "include_usage" or not isinstance(v, bool) for k, v in options.items())):
            raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}")
        if kind == "chat":
            self._messages(body.get("messages"))
            self._template_kwargs(body.get("chat_template_kwargs"), "chat_template_kwargs")
        elif kind == "completion":
            prompt = body.get("prompt")
            if prompt is None:
                raise BadRequest("'prompt' is required")
            self._bounded("prompt", json_size(prompt, "prompt"))
            if isinstance(prompt, dict):  # an llm entry stage reads per-item sampling params from it
                self._template_kwargs(prompt.get("chat_template_kwargs"), "prompt.chat_template_kwargs")
                if prompt.get("sampling_params") is not None:
                    if not isinstance(prompt["sampling_params"], dict):
                        raise BadRequest("'prompt.sampling_params' must be an object")
                    self._sampling(prompt["sampling_params"], "prompt.sampling_params.")
        else:
            key = "input" if kind == "speech" else "prompt"
            text = body.get(key)
            if not isinstance(text, str) or not text:
                raise BadRequest(f"{key!r} is required (a string)")
            self._bounded(key, len(text))
        # Fields the stages never read still travel; bound them all together.
        total = json_size(body, "body")
        if total > self.limits.max_prompt_chars * 2 + 65536:
            raise BadRequest(f"the body holds more than {self.limits.max_prompt_chars * 2 + 65536} characters")
        self.timeout(body)

    def _bounded(self, field: str, chars: int) -> None:
        if chars > self.limits.max_prompt_chars:
            raise BadRequest(f"{field!r} is longer than {self.limits.max_prompt_chars} characters "
                             "(spec.master.limits.maxPromptChars)")

    def timeout(self, body: dict[str, Any]) -> float:
        """The request's deadline in seconds: the pipeline's, or the request's own `timeout` within the cap."""
        value = body.get("timeout")
        if value is None:
            return self.limits.request_timeout_seconds
        cap = self.limits.max_request_timeout_seconds
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= cap:
            raise BadRequest(f"'timeout' must be a number of seconds above 0 and at most {cap:g} "
                             "(spec.master.limits.maxRequestTimeoutSeconds)")
        return float(value)

    def _sampling(self, params: dict[str, Any], where: str) -> None:
        for key in _NUMBERS:
            value = params.get(key)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise BadRequest(f"'{where}{key}' must be a number")
        for key in ("max_tokens", "max_completion_tokens"):
            _int(params, key, 1, self.limits.max_tokens, f"{where}{key}")
        _int(params, "n", 1, self.limits.max_n, f"{where}n")
        for key in ("top_k", "seed", "top_logprobs", "min_tokens"):
            _int(params, key, _INT_MIN, _INT_MAX, f"{where}{key}")
        for key in _BOOLS:
            if params.get(key) is not None and not isinstance(params[key], bool):
                raise BadRequest(f"'{where}{key}' must be true or false")
        if params.get("logprobs") is not None and not isinstance(params["logprobs"], (bool, int)):
            raise BadRequest(f"'{where}logprobs' must be a boolean or an integer")
        stop = params.get("stop")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise BadRequest(f"'{where}stop' must be a string or a list of strings")

    def _stage_sampling(self, per_stage: Any) -> None:
        if per_stage is None:
            return
        if not isinstance(per_stage, dict):
            raise BadRequest("'stage_sampling_params' must be an object {stage: {param: value}}")
        for stage, params in per_stage.items():
            if stage not in self.stages:
                raise BadRequest(f"stage_sampling_params names no stage of this pipeline: {stage!r}")
            if not isinstance(params, dict):
                raise BadRequest(f"'stage_sampling_params.{stage}' must be an object")
            self._sampling(params, f"stage_sampling_params.{stage}.")

    def _messages(self, messages: Any) -> None:
        if messages is None:
            raise BadRequest("'messages' is required")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        if len(messages) > self.limits.max_messages:
            raise BadRequest(f"'messages' holds more than {self.limits.max_messages} messages "
                             "(spec.master.limits.maxMessages)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise BadRequest(f"'messages[{i}]' must be an object {{role, content}}")
            if not isinstance(m.get("role"), str):
                raise BadRequest(f"'messages[{i}].role' must be a string")
            content = m.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                        raise BadRequest(f"'messages[{i}].content[{j}]' must be an object with a string 'type'")
            elif content is not None and not isinstance(content, str):
                raise BadRequest(f"'messages[{i}].content' must be a string or a list of content parts")
        # Media parts (base64 images and audio) count by their own limits (pixels, seconds) and the body's size,
        # not as prompt characters: a photo is megabytes of base64.
        text_only = [{**m, "content": [p for p in m["content"] if p.get("type") not in MEDIA_PART_TYPES]}
                     if isinstance(m.get("content"), list) else m for m in messages]
        if json_size(text_only, "messages") > self.limits.max_prompt_chars:
            raise BadRequest(f"'messages' hold more than {self.limits.max_prompt_chars} characters "
                             "(spec.master.limits.maxPromptChars)")

    def _template_kwargs(self, kwargs: Any, field: str) -> None:
        if kwargs is None:
            return
        if not isinstance(kwargs, dict):
            raise BadRequest(f"{field!r} must be an object")
        reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS and k != "chat_template")
        if reserved:
            raise BadRequest(f"'{field}.{reserved[0]}' is not a template variable and cannot be set by a request")

    def image_size(self, size: Any) -> tuple[int, int] | None:
        if size in (None, "auto"):
            return None
        w, _, h = str(size).partition("x") if isinstance(size, str) else ("", "", "")
        if not (w.isdigit() and h.isdigit() and len(w) <= 6 and len(h) <= 6 and int(w) > 0 and int(h) > 0):
            raise BadRequest(f"'size' must be WIDTHxHEIGHT (e.g. 256x256), got {str(size)[:32]!r}")
        if int(w) * int(h) > self.limits.max_image_pixels:
            raise BadRequest(f"'size' {w}x{h} is more than {self.limits.max_image_pixels} pixels "
                             "(spec.master.limits.maxImagePixels)")
        return int(w), int(h)
