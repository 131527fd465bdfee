"""Stock input processors: the usual ways one stage's output becomes the next stage's input.

An input processor is `fn(upstream: dict[str, value], request) -> inputs`, run in
the downstream stage's process (see README-runtime.md). In `whole` mode each
upstream value is the list of that stage's chunks; in `stream` mode it is one
chunk. The chunks of an `llm` stage are dicts `{"text", "token_ids", ...}`
(see engines/vllm.py); these processors also accept plain strings and lists.

Pure Python on purpose (no torch, no vLLM): usable from tests and the master's
side of things alike.
"""

from __future__ import annotations

from typing import Any

from .wire import Array, RequestInfo

__all__ = [
    "collect", "llm_text", "llm_tokens", "llm_text_as_chat", "thinker_to_talker", "talker_to_code2wav",
    "ar_to_diffusion", "negative_prompt",
]


def _chunks(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) and not _is_ids(value) else [value]


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _one(upstream: dict[str, Any]) -> Any:
    if len(upstream) != 1:
        raise ValueError(f"this input processor takes one upstream stage, got {sorted(upstream)}")
    return next(iter(upstream.values()))


def collect(chunks: Any) -> dict[str, Any]:
    """One upstream's chunks merged: {"text", "token_ids", "prompt_token_ids", "finish_reason", "extra"}.

    Extra tensors of several chunks are kept as lists (in chunk order).
    """
    text: list[str] = []
    ids: list[int] = []
    out: dict[str, Any] = {"prompt_token_ids": None, "finish_reason": None, "extra": {}}
    for c in _chunks(chunks):
        if isinstance(c, dict):
            text.append(c.get("text") or "")
            ids += c.get("token_ids") or []
            if c.get("prompt_token_ids") is not None and out["prompt_token_ids"] is None:
                out["prompt_token_ids"] = list(c["prompt_token_ids"])
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
            for k, v in (c.get("extra") or {}).items():
                out["extra"].setdefault(k, []).append(v)
        elif isinstance(c, str):
            text.append(c)
        elif isinstance(c, (bytes, bytearray, memoryview)):
            text.append(bytes(c).decode("utf-8", errors="replace"))
        elif _is_ids(c):
            ids += list(c)
        elif c is not None:
            raise ValueError(f"cannot read text or token ids from a {type(c).__name__} chunk")
    out["text"] = "".join(text)
    out["token_ids"] = ids
    return out


def llm_text(upstream: dict[str, Any], request: RequestInfo) -> str:
    """The upstream's generated text, as this stage's text prompt (no chat template again)."""
    return collect(_one(upstream))["text"]


def llm_text_as_chat(upstream: dict[str, Any], request: RequestInfo) -> list[dict[str, str]]:
    """The upstream's generated text as one user message (this stage applies its own chat template)."""
    return [{"role": "user", "content": collect(_one(upstream))["text"]}]


def llm_tokens(upstream: dict[str, Any], request: RequestInfo) -> dict[str, Any]:
    """The upstream's generated token ids, as this stage's prompt (stages that share a vocabulary)."""
    return {"prompt_token_ids": collect(_one(upstream))["token_ids"]}


def thinker_to_talker(upstream: dict[str, Any], request: RequestInfo) -> dict[str, Any]:
    """The thinker's whole sequence (its prompt, then what it generated) as the talker's prompt ids.

    For thinker and talker sharing a vocabulary; a talker that consumes hidden
    states needs a model-specific processor (the thinker's `extra` tensors reach it).
    """
    c = collect(_one(upstream))
    return {"prompt_token_ids": (c["prompt_token_ids"] or []) + c["token_ids"]}


def talker_to_code2wav(upstream: dict[str, Any], request: RequestInfo) -> dict[str, Any] | None:
    """Stream mode: each talker chunk's token ids, as codec codes (int32) for a vocoder; None skips empty chunks."""
    ids = collect(_one(upstream))["token_ids"]
    if not ids:
        return None
    import struct

    return {"codes": Array("int32", (len(ids),), struct.pack(f"<{len(ids)}i", *ids))}


def ar_to_diffusion(upstream: dict[str, Any], request: RequestInfo) -> dict[str, Any]:
    """An autoregressive stage's output as a diffusion stage's conditioning.

    Hidden states the AR model returned (`extra.hidden_states` or
    `extra.prompt_embeds`, the last chunk's) become `prompt_embeds`; otherwise
    the generated text and token ids are passed (`prompt`, `prompt_token_ids`),
    for the diffusion model's own text encoder. The output of a `negative`
    CFG companion (input `<stage>:negative`, see `negative_prompt`) becomes the
    same fields prefixed `negative_`: the unconditional branch of guidance.
    """
    main = {k: v for k, v in upstream.items() if ":" not in k}
    out = _conditioning(collect(_one(main)), "")
    for name, chunks in upstream.items():
        if name.endswith(":negative"):
            out |= _conditioning(collect(chunks), "negative_")
    return out


def _conditioning(c: dict[str, Any], prefix: str) -> dict[str, Any]:
    for name in ("prompt_embeds", "hidden_states"):
        if c["extra"].get(name):
            return {f"{prefix}prompt_embeds": c["extra"][name][-1]}
    return {f"{prefix}prompt": c["text"], f"{prefix}prompt_token_ids": c["token_ids"]}


def negative_prompt(item: Any, sampling_params: dict[str, Any], request: RequestInfo) -> list[dict[str, Any]]:
    """Stock prompt expansion (a stage's `promptExpand`): the request's `negative_prompt` as one CFG
    companion of role `negative`, in the shape of the stage's own input (a prompt string, or one user
    message for chat messages); none without one."""
    negative = request.extra.get("negative_prompt")
    if negative is None:
        return []
    if isinstance(item, str):
        return [{"role": "negative", "input": negative}]
    if isinstance(item, list):
        return [{"role": "negative", "input": [{"role": "user", "content": negative}]}]
    if isinstance(item, dict) and ("prompt" in item or "messages" in item):
        key = "prompt" if "prompt" in item else "messages"
        value = negative if key == "prompt" else [{"role": "user", "content": negative}]
        return [{"role": "negative", "input": {k: v for k, v in item.items()
                                              if k not in ("prompt", "messages", "prompt_token_ids")} | {key: value}}]
    raise ValueError(f"negative_prompt: this stage's input is not a prompt or messages ({type(item).__name__})")
