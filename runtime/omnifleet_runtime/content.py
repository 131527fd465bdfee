"""Chat content parts the master decodes once: images and audio, bounded, for the entry stage.

A chat message's `content` may be a list of OpenAI content parts. `text` parts
stay as they are. These become plain values every stage runtime can read
without a decoder of its own (no Pillow or libsndfile needed in the stages):

- `image_url` (`{"url": "data:image/...;base64,..."}`, or an http(s) URL of a
  host the pipeline allows) -> `{"type": "image", "image": {"dtype": "uint8",
  "shape": [height, width, 3], "data": RGB bytes}}`;
- `input_audio` (`{"data": base64, "format": "wav" | "flac" | "mp3" | "ogg"}`)
  -> `{"type": "audio", "audio": {"dtype": "float32", "shape": [samples],
  "data": mono samples}, "sample_rate": hz}`.

Limits are checked before decoding: pixels from the image header
(`maxImagePixels`), seconds from the audio header (`maxInputAudioSeconds`), so
a small file that expands into a huge one is refused unread. A part the master
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
                          max_bytes: int, hosts: frozenset[str], fetch: Fetch) -> list[dict[str, Any]]:
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
                raw = await _image_bytes(part.get("image_url"), at, max_bytes, hosts, fetch)
                parts.append(await asyncio.to_thread(decode_image, raw, at, max_image_pixels))
            elif kind == "input_audio":
                parts.append(await asyncio.to_thread(decode_audio, part.get("input_audio"), at, max_audio_seconds))
            else:
                raise BadRequest(f"'{at}': content parts of type {str(kind)[:32]!r} are not accepted "
                                 "(text, image_url and input_audio are)")
        out.append({**m, "content": parts})
    return out


def strip_media(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each decoded image or audio replaced by its shape: what stages past the entry get."""
    def light(part: Any) -> Any:
        if isinstance(part, dict) and part.get("type") in ("image", "audio"):
            value = part[part["type"]]
            return {**part, part["type"]: {"dtype": value["dtype"], "shape": value["shape"], "data": None}}
        return part

    return [{**m, "content": [light(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]


async def _image_bytes(spec: Any, at: str, max_bytes: int, hosts: frozenset[str], fetch: Fetch) -> bytes:
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise BadRequest(f"'{at}.image_url.url' must be a string (a data URL or an http(s) URL)")
    if url.startswith("data:"):
        m = _DATA_URL.match(url)
        if m is None or not (m.group("mime") or "image/").lower().startswith("image/"):
            raise BadRequest(f"'{at}.image_url.url' is not a base64 data URL of an image (data:image/...;base64,...)")
        return _b64(url[m.end():], f"{at}.image_url.url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"'{at}.image_url.url' must be a data URL or an http(s) URL")
    if parts.hostname.lower() not in hosts:
        raise BadRequest(f"'{at}.image_url.url': the master fetches no URL of host {parts.hostname[:253]!r} "
                         "(send the image as a data URL, or list the host in spec.master.mediaUrlHosts)")
    try:
        return await fetch(url, max_bytes)
    except BadRequest:
        raise
    except Exception as e:  # the fetch's own failure is the request's problem, named
        raise BadRequest(f"'{at}.image_url.url' could not be fetched: {type(e).__name__}: {str(e)[:200]}") from None


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
