"""Chat messages with the media the master decoded -> a chat template's input and vLLM's `multi_modal_data`.

The entry stage receives image parts as `{"type": "image", "image": {dtype: uint8, shape: [h, w, 3], data}}`
and audio parts as `{"type": "audio", "audio": {dtype: float32, shape: [samples], data}, "sample_rate"}`
(content.py). `split_media` turns each into a bare `{"type": "image"}` / `{"type": "audio"}` part, which a
multimodal model's chat template renders as its placeholder (Qwen2.5-Omni's `<|vision_bos|><|IMAGE|>
<|vision_eos|>`), and collects the media as vLLM takes them: images as PIL images, audio as `(samples,
rate)` (vLLM resamples to the model's feature extractor's rate); vLLM's processor expands each placeholder
to the media's length. Anything else in a content list but text is refused, naming the part.
"""

from __future__ import annotations

from typing import Any

from ..wire import Array
from .base import BadInput


def split_media(messages: list[dict[str, Any]], stage: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(messages for the chat template, multi_modal_data or None when they hold no media)."""
    media: dict[str, list[Any]] = {"image": [], "audio": []}
    rendered = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [_part(p, f"stage {stage!r}: messages[{i}].content[{j}]", media)
                                  for j, p in enumerate(content)]}
        elif not isinstance(content, (str, type(None))):
            raise BadInput(f"stage {stage!r}: messages[{i}].content must be a string or a list of content parts")
        rendered.append(m)
    if not (media["image"] or media["audio"]):
        return rendered, None
    return rendered, {k: v if len(v) > 1 else v[0] for k, v in media.items() if v}


def _part(part: Any, at: str, media: dict[str, list[Any]]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image" and isinstance(part.get("image"), (dict, Array)):
        pixels = _ndarray(part["image"], at, "uint8")
        if pixels.ndim != 3 or pixels.shape[2] != 3:
            raise BadInput(f"{at}: an image must be uint8 [height, width, 3], not {list(pixels.shape)}")
        from PIL import Image

        media["image"].append(Image.fromarray(pixels, "RGB"))
        return {"type": "image"}
    if kind == "audio" and isinstance(part.get("audio"), (dict, Array)):
        rate = part.get("sample_rate")
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise BadInput(f"{at}: an audio part needs a positive integer sample_rate")
        samples = _ndarray(part["audio"], at, "float32")
        if samples.ndim != 1:
            raise BadInput(f"{at}: audio must be mono float32 [samples], not {list(samples.shape)}")
        media["audio"].append((samples, rate))
        return {"type": "audio"}
    raise BadInput(f"{at}: a content part must be text, an image or audio (as the master decodes them); "
                   f"got {str(kind)[:32]!r}")


def _ndarray(value: Any, at: str, dtype: str) -> Any:
    """A media part's array (a wire Array or its plain {dtype, shape, data} form) as numpy, checked."""
    import numpy as np

    get = (lambda k: getattr(value, k)) if isinstance(value, Array) else value.get
    shape, data = get("shape"), get("data")
    if get("dtype") != dtype or not isinstance(shape, (list, tuple)) or data is None:
        raise BadInput(f"{at}: expected {dtype} data with a shape, got dtype {str(get('dtype'))[:16]!r}")
    try:
        return np.frombuffer(memoryview(data), dtype=dtype).reshape([int(n) for n in shape])
    except (TypeError, ValueError) as e:
        raise BadInput(f"{at}: the data is not {dtype} of shape {list(shape)[:4]} ({e})") from None
