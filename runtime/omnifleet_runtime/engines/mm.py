"""Chat messages with the media the master decoded -> a chat template's input and vLLM's `multi_modal_data`.

The entry stage receives image parts as `{"type": "image", "image": {dtype: uint8, shape: [h, w, 3], data}}`,
audio parts as `{"type": "audio", "audio": {dtype: float32, shape: [samples], data}, "sample_rate"}` and
video parts as `{"type": "video", "file": bytes, "fps", "total_frames", "max_frames"}` (the master decodes
videos for vLLM stages no further than their header: content.py). `split_media` turns each into a bare
`{"type": "image"}` / `{"type": "audio"}` / `{"type": "video"}` part, which a multimodal model's chat
template renders as its placeholder (Qwen2.5-Omni's `<|vision_bos|><|IMAGE|><|vision_eos|>`), and collects
the media as vLLM takes them: images as PIL images, audio as `(samples, rate)` (vLLM resamples to the
model's feature extractor's rate), a video as `(frames, metadata)` from the video loader vLLM's OpenAI
server picks for the model (by its video processor: Qwen2-VL's takes 2 frames a second, the default takes
`max_frames` evenly), so the engine gets the frames vLLM itself would; vLLM's processor expands each
placeholder to the media's length. (Frames the master decoded, `"video": {dtype: uint8, shape: [frames, h,
w, 3], data}` with `frame_indices`, are taken as they are, with the metadata the default loader gives.)
Anything else in a content list but text is refused, naming the part.
"""

from __future__ import annotations

import functools
from typing import Any

from ..wire import Array
from .base import BadInput


def split_media(messages: list[dict[str, Any]], stage: str,
                model: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(messages for the chat template, multi_modal_data or None when they hold no media); model (its path)
    picks the video loader."""
    media: dict[str, list[Any]] = {"image": [], "audio": [], "video": []}
    rendered = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [_part(p, f"stage {stage!r}: messages[{i}].content[{j}]", media, model)
                                  for j, p in enumerate(content)]}
        elif not isinstance(content, (str, type(None))):
            raise BadInput(f"stage {stage!r}: messages[{i}].content must be a string or a list of content parts")
        rendered.append(m)
    if not any(media.values()):
        return rendered, None
    return rendered, {k: v if len(v) > 1 else v[0] for k, v in media.items() if v}


def _part(part: Any, at: str, media: dict[str, list[Any]], model: str | None = None) -> dict[str, Any]:
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
    if kind == "video" and isinstance(part.get("file"), (bytes, bytearray, memoryview)):
        n = part.get("max_frames")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise BadInput(f"{at}: a video file part needs a positive integer max_frames")
        try:
            media["video"].append(load_video(bytes(part["file"]), n, model))
        except ValueError as e:  # vLLM's loader: not a video it can read
            raise BadInput(f"{at}: the video could not be decoded: {str(e)[:200]}") from None
        return {"type": "video"}
    if kind == "video" and isinstance(part.get("video"), (dict, Array)):
        frames = _ndarray(part["video"], at, "uint8")
        if frames.ndim != 4 or frames.shape[3] != 3 or frames.shape[0] == 0:
            raise BadInput(f"{at}: a video must be uint8 [frames, height, width, 3], not {list(frames.shape)}")
        fps, total, taken = part.get("fps"), part.get("total_frames"), part.get("frame_indices")
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps < 0 or not isinstance(total, int) \
                or not isinstance(taken, list) or len(taken) != frames.shape[0] \
                or not all(isinstance(i, int) and 0 <= i < total for i in taken):
            raise BadInput(f"{at}: a video part needs fps >= 0, total_frames and one frame index per frame")
        media["video"].append((frames, {  # what vLLM's OpenCV loader says of the frames it took
            "total_num_frames": total, "fps": float(fps), "duration": total / fps if fps > 0 else 0,
            "video_backend": "opencv", "frames_indices": taken, "do_sample_frames": len(taken) == total}))
        return {"type": "video"}
    raise BadInput(f"{at}: a content part must be text, an image, audio or video (as the master decodes them); "
                   f"got {str(kind)[:32]!r}")


def load_video(data: bytes, num_frames: int, model: str | None) -> tuple[Any, dict[str, Any]]:
    """(frames, metadata) as vLLM's OpenAI server loads a video for model: the loader registered for the
    model's video processor (the default one where it has none), at most num_frames frames."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    return VIDEO_LOADER_REGISTRY.load(_video_backend(model)).load_bytes(data, num_frames=num_frames)


@functools.lru_cache(maxsize=16)
def _video_backend(model: str | None) -> str:
    """The video loader's name for model, looked up once per model (the lookup reads its config files)."""
    from vllm import envs
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    backend = None
    if model is not None:
        try:
            from vllm.transformers_utils.processor import get_video_processor_cls_name_from_config

            backend = VIDEO_LOADER_REGISTRY.get_backend_for_video_processor(
                get_video_processor_cls_name_from_config(model))
        except (ImportError, AttributeError, OSError):  # a vLLM without per-model loaders: its default
            backend = None
    return backend or envs.VLLM_VIDEO_LOADER_BACKEND


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
