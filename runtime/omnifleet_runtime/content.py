"""Chat content parts the master decodes once: images and audio, bounded, for the entry stage.

A chat message's `content` may be a list of OpenAI content parts. `text` parts
stay as they are. These become plain values every stage runtime can read
without a decoder of its own (no Pillow or libsndfile needed in the stages):

- `image_url` (`{"url": "data:image/...;base64,..."}`, or an http(s) URL of a
  host the pipeline allows) -> `{"type": "image", "image": {"dtype": "uint8",
  "shape": [height, width, 3], "data": RGB bytes}}`;
- `input_audio` (`{"data": base64, "format": "wav" | "flac" | "mp3" | "ogg"}`)
  -> `{"type": "audio", "audio": {"dtype": "float32", "shape": [samples],
  "data": mono samples}, "sample_rate": hz}`;
- `video_url` (`{"url": "data:video/...;base64,..."}`, or an allowed http(s)
  URL) -> `{"type": "video", "fps": source fps, "total_frames": n,
  "max_frames": maxVideoFrames, ...}` with, for an entry stage run by vLLM
  (`llm`, `vllm-omni`), the file itself (`"file": bytes`): the stage decodes it
  with the video loader vLLM's own OpenAI server picks for its model (which
  frames a model takes is the model's: Qwen2-VL's loader samples 2 per second),
  so the engine gets what vLLM would give it; for any other entry stage the
  frames (`"video": {"dtype": "uint8", "shape": [frames, height, width, 3],
  "data": RGB bytes}, "frame_indices": [...]`), at most `maxVideoFrames`,
  evenly spread as vLLM's default (OpenCV) loader spreads them. Either way the
  master reads the header first: frame size, frame count, and the pixels the
  frames taken would hold (`maxVideoPixels`).

Limits are checked before decoding: pixels from the image header
(`maxImagePixels`, per frame for a video), seconds from the audio header
(`maxInputAudioSeconds`), so a small file that expands into a huge one is
refused unread. A part the master
cannot take is a 400 naming it (`messages[i].content[j]`). Decoding is CPU
work: it runs in a worker thread, never on the event loop. Only the entry
stage receives the decoded media (`strip_media` gives the other stages the
same messages without the bytes).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from .limits import BadRequest

FETCH_TIMEOUT_S = 10.0
AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg")
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.I)

Fetch = Callable[[str, int], Awaitable[bytes]]


def has_media(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") not in (None, "text") for p in m["content"])
        for m in messages)


async def decode_messages(messages: list[dict[str, Any]], *, max_image_pixels: int, max_audio_seconds: float,
                          max_bytes: int, hosts: frozenset[str], fetch: Fetch, max_video_frames: int = 32,
                          max_video_pixels: int = 32 * 1920 * 1080, video_file: bool = False) -> list[dict[str, Any]]:
    """The messages with every media part decoded (a new list; the input is not changed)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            at = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                parts.append(part)
            elif kind == "image_url":
                raw = await _media_bytes(part.get("image_url"), at, "image", max_bytes, hosts, fetch)
                parts.append(await asyncio.to_thread(decode_image, raw, at, max_image_pixels))
            elif kind == "input_audio":
                parts.append(await asyncio.to_thread(decode_audio, part.get("input_audio"), at, max_audio_seconds))
            elif kind == "video_url":
                raw = await _media_bytes(part.get("video_url"), at, "video", max_bytes, hosts, fetch)
                parts.append(await asyncio.to_thread(decode_video, raw, at, max_image_pixels, max_video_frames,
                                                     max_video_pixels, video_file))
            else:
                raise BadRequest(f"'{at}': content parts of type {str(kind)[:32]!r} are not accepted "
                                 "(text, image_url, input_audio and video_url are)")
        out.append({**m, "content": parts})
    return out


def strip_media(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each decoded image, audio or video replaced by its shape: what stages past the entry get."""
    def light(part: Any) -> Any:
        if isinstance(part, dict) and part.get("type") == "video" and "file" in part:
            return {**part, "file": None}
        if isinstance(part, dict) and part.get("type") in ("image", "audio", "video"):
            value = part[part["type"]]
            return {**part, part["type"]: {"dtype": value["dtype"], "shape": value["shape"], "data": None}}
        return part

    return [{**m, "content": [light(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]


async def _media_bytes(spec: Any, at: str, kind: str, max_bytes: int, hosts: frozenset[str], fetch: Fetch) -> bytes:
    field = f"{at}.{kind}_url.url"
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise BadRequest(f"'{field}' must be a string (a data URL or an http(s) URL)")
    if url.startswith("data:"):
        m = _DATA_URL.match(url)
        if m is None or not (m.group("mime") or f"{kind}/").lower().startswith(f"{kind}/"):
            raise BadRequest(f"'{field}' is not a base64 data URL of {'an' if kind == 'image' else 'a'} {kind} "
                             f"(data:{kind}/...;base64,...)")
        return _b64(url[m.end():], field)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"'{field}' must be a data URL or an http(s) URL")
    if parts.hostname.lower() not in hosts:
        raise BadRequest(f"'{field}': the master fetches no URL of host {parts.hostname[:253]!r} "
                         f"(send the {kind} as a data URL, or list the host in spec.master.mediaUrlHosts)")
    try:
        return await fetch(url, max_bytes)
    except BadRequest:
        raise
    except Exception as e:  # the fetch's own failure is the request's problem, named
        raise BadRequest(f"'{field}' could not be fetched: {type(e).__name__}: {str(e)[:200]}") from None


async def fetch_bounded(url: str, max_bytes: int) -> bytes:
    """The body of a GET of url: at most max_bytes, within FETCH_TIMEOUT_S, no redirects (a redirect could
    lead to a host nobody allowed)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise BadRequest(f"fetching {url[:200]!r} answered HTTP {resp.status}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > max_bytes:
                    raise BadRequest(f"{url[:200]!r} is larger than {max_bytes} bytes (spec.master.limits.maxBodyBytes)")
            return bytes(body)


def _b64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"'{field}' is not valid base64") from None


def decode_image(raw: bytes, at: str, max_pixels: int) -> dict[str, Any]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as img:  # reads the header only
            width, height = img.size
            if width * height > max_pixels:
                raise BadRequest(f"'{at}': an image of {width}x{height} is more than {max_pixels} pixels "
                                 "(spec.master.limits.maxImagePixels)")
            rgb = img.convert("RGB")
    except BadRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadRequest(f"'{at}': not an image the master can read ({type(e).__name__})") from None
    return {"type": "image", "image": {"dtype": "uint8", "shape": [height, width, 3], "data": rgb.tobytes()}}


def decode_audio(spec: Any, at: str, max_seconds: float) -> dict[str, Any]:
    import soundfile

    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise BadRequest(f"'{at}.input_audio' must be an object {{data: base64, format}}")
    fmt = spec.get("format")
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(f"'{at}.input_audio.format' must be one of {', '.join(AUDIO_FORMATS)}")
    raw = _b64(spec["data"], f"{at}.input_audio.data")
    try:
        info = soundfile.info(io.BytesIO(raw))
        if info.samplerate <= 0 or info.frames < 0:
            raise ValueError("no audio")
        seconds = info.frames / info.samplerate
        if seconds > max_seconds:
            raise BadRequest(f"'{at}': {seconds:.1f} s of audio is more than {max_seconds:g} s "
                             "(spec.master.limits.maxInputAudioSeconds)")
        samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except BadRequest:
        raise
    except Exception as e:  # libsndfile's refusal of a file that is not audio of that format
        raise BadRequest(f"'{at}.input_audio': not {fmt} audio the master can read ({type(e).__name__})") from None
    mono = samples.mean(axis=1, dtype="float32") if samples.shape[1] > 1 else samples[:, 0]
    return {"type": "audio", "audio": {"dtype": "float32", "shape": [int(mono.shape[0])],
                                       "data": mono.astype("<f4").tobytes()}, "sample_rate": int(rate)}


def decode_video(raw: bytes, at: str, max_pixels: int, max_frames: int, max_total_pixels: int,
                 file: bool = False) -> dict[str, Any]:
    """At most max_frames RGB frames, sampled as vLLM's OpenCV loader samples them (evenly over the frames the
    stream can present, every frame when there are few enough), with what its metadata says of them; with
    file, the header checked and the file itself instead of frames (a vLLM stage decodes it)."""
    try:
        import cv2
    except ImportError:
        raise BadRequest(f"'{at}': this master cannot read video (opencv-python-headless is not installed)") from None
    import numpy as np

    stream = io.BytesIO(raw)  # held until the capture is released: OpenCV reads it without a reference of its own
    cap = cv2.VideoCapture(stream, _stream_backend(cv2), [])
    try:
        if not cap.isOpened():
            raise BadRequest(f"'{at}': not a video the master can read")
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width <= 0 or height <= 0:
            raise BadRequest(f"'{at}': not a video the master can read (no frame size)")
        if width * height > max_pixels:
            raise BadRequest(f"'{at}': video frames of {width}x{height} are more than {max_pixels} pixels "
                             "(spec.master.limits.maxImagePixels)")
        total, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), float(cap.get(cv2.CAP_PROP_FPS))
        if total > 0 and cap.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
            # A header may count frames the stream cannot present: sample over the ones it can.
            visible = int(cap.get(cv2.CAP_PROP_POS_FRAMES))
            at_end = not cap.grab()
            cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
            if at_end and 0 < visible < total - 1:
                total = visible
        if total <= 0:
            raise BadRequest(f"'{at}': the video has no frames the master can read")
        n = min(max_frames, total)
        if n * width * height > max_total_pixels:
            raise BadRequest(f"'{at}': {n} frames of {width}x{height} are more than {max_total_pixels} pixels "
                             "(spec.master.limits.maxVideoPixels; maxVideoFrames takes fewer frames)")
        if file:
            return {"type": "video", "file": raw, "fps": fps, "total_frames": total, "max_frames": max_frames}
        wanted = list(range(total)) if n == total else np.linspace(0, total - 1, n, dtype=int).tolist()
        want = set(wanted)
        frames = np.empty((len(want), height, width, 3), dtype=np.uint8)
        got: list[int] = []
        for idx in range(max(wanted) + 1):
            if not cap.grab():
                continue  # an unreadable frame is skipped, as vLLM's loader skips it
            if idx in want:
                ok, frame = cap.retrieve()
                if ok and frame.shape[:2] == (height, width):
                    frames[len(got)] = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                    got.append(idx)
    finally:
        cap.release()
    if not got:
        raise BadRequest(f"'{at}': no frame of the video could be decoded")
    frames = frames[:len(got)]
    return {"type": "video", "video": {"dtype": "uint8", "shape": list(frames.shape), "data": frames.tobytes()},
            "fps": fps, "total_frames": total, "max_frames": max_frames, "frame_indices": got}


def _stream_backend(cv2: Any) -> int:
    """The first OpenCV backend that reads from a Python stream (FFmpeg in the wheels); vLLM picks the same."""
    import cv2.videoio_registry as vr

    for backend in vr.getStreamBufferedBackends():
        if not vr.hasBackend(backend):
            continue
        if not vr.isBackendBuiltIn(backend):
            _, abi, api = vr.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and api < 2):
                continue
        return backend
    return cv2.CAP_ANY
