"""Images and audio for the client, made in the master: PNG and WAV encoders (standard library), FLAC and
MP3 through libsndfile (soundfile, imported only for those).

Final image stages send uint8 pixels as `wire.Array`s ([n, h, w, c], [h, w, c]
or [h, w]; c is 1, 2, 3 or 4), bare or as `{"images": ...}` / `{"image": ...}`.
Final audio stages send samples as `wire.Array`s (float32/float64 in [-1, 1],
or int16; [samples] or [samples, channels]), bare or as `{"audio": ...,
"sample_rate": hz}` (`sr` is accepted too; a bare array is 24 kHz). The master
never imports torch for this: PNG is zlib + struct, WAV is the `wave` module,
FLAC and MP3 are libsndfile's encoders. Encoding is CPU work: the API runs it in a worker thread,
never on its event loop, and refuses (MediaError) an image of more than
`max_pixels` or audio of more than `max_seconds` before encoding anything.
"""

from __future__ import annotations

import io
import struct
import wave
import zlib
from dataclasses import dataclass
from typing import Any

from .wire import Array

DEFAULT_SAMPLE_RATE = 24000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey+alpha, RGB, RGBA)


class MediaError(ValueError):
    """A final output that is not an image or audio the master can encode; the text says why."""


# ---------------------------------------------------------------- images


def png(pixels: Any, width: int, height: int, channels: int) -> bytes:
    """A PNG (8 bits per channel, no interlace) of row-major pixels."""
    if channels not in _COLOR_TYPES:
        raise MediaError(f"an image must have 1, 2, 3 or 4 channels, not {channels}")
    data = memoryview(pixels).cast("B")
    stride = width * channels
    if data.nbytes != stride * height:
        raise MediaError(f"{data.nbytes} bytes are not a {width}x{height}x{channels} image")
    raw = bytearray((stride + 1) * height)  # each row: filter type 0, then the row
    for y in range(height):
        raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)] = data[y * stride:(y + 1) * stride]

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPES[channels], 0, 0, 0)
    return PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(raw), 6)) + chunk(b"IEND", b"")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR."""
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise MediaError("not a PNG")
    return struct.unpack(">II", data[16:24])


def images_of(payload: Any, max_pixels: int | None = None) -> list[bytes]:
    """PNGs of the images in one final-output chunk."""
    if isinstance(payload, dict):
        payload = payload.get("images", payload.get("image"))
    items = payload if isinstance(payload, list) else [payload]
    out = []
    for a in items:
        if not isinstance(a, Array):
            raise MediaError(f"an image chunk must hold uint8 arrays, got {type(a).__name__}")
        if a.dtype != "uint8":
            raise MediaError(f"image pixels must be uint8, got {a.dtype}")
        shape = tuple(a.shape)
        if len(shape) == 2:
            shape = (1, *shape, 1)
        elif len(shape) == 3:
            shape = (1, *shape)
        if len(shape) != 4:
            raise MediaError(f"an image array must be [h, w], [h, w, c] or [n, h, w, c], got {list(a.shape)}")
        n, h, w, c = shape
        if max_pixels is not None and h * w > max_pixels:
            raise MediaError(f"a {w}x{h} image is more than the {max_pixels} pixels the master encodes")
        view = memoryview(a.data).cast("B")
        size = h * w * c
        out += [png(view[i * size:(i + 1) * size], w, h, c) for i in range(n)]
    return out


# ---------------------------------------------------------------- audio


@dataclass
class Audio:
    pcm: bytes  # 16-bit signed little-endian, interleaved
    sample_rate: int
    channels: int


AUDIO_BLOCK = 65536  # samples converted at a time (see audio_of)


def audio_of(payload: Any, max_seconds: float | None = None) -> Audio:
    """16-bit PCM of one final-output chunk."""
    rate = DEFAULT_SAMPLE_RATE
    if isinstance(payload, dict):
        rate = payload.get("sample_rate", payload.get("sr", rate))
        payload = payload.get("audio")
    if not isinstance(payload, Array):
        raise MediaError(f"an audio chunk must hold an array of samples, got {type(payload).__name__}")
    if not isinstance(rate, int) or isinstance(rate, bool) or not 1 <= rate <= 768_000:
        raise MediaError(f"bad sample rate {rate!r}")
    shape = tuple(payload.shape)
    if len(shape) not in (1, 2):
        raise MediaError(f"audio must be [samples] or [samples, channels], got {list(shape)}")
    channels = shape[1] if len(shape) == 2 else 1
    if max_seconds is not None and shape[0] > max_seconds * rate:
        raise MediaError(f"{shape[0] / rate:.1f}s of audio is more than the {max_seconds:g}s the master encodes")
    raw = memoryview(payload.data).cast("B")
    if payload.dtype == "int16":
        return Audio(bytes(raw), rate, channels)  # the wire's arrays are little-endian, as PCM is
    if payload.dtype not in ("float32", "float64"):
        raise MediaError(f"audio samples must be float32, float64 or int16, got {payload.dtype}")
    import numpy  # here: a master whose pipeline makes no audio never loads numpy

    # In numpy, not per sample in Python (0.3 us a sample: 4 ms of the master's loop for half a second of
    # 24 kHz audio). Clipped to [-1, 1] and truncated toward zero in float64; NaN is silence. In blocks, so
    # that the float64 copy is a block's (512 KiB), not the chunk's (115 MB for the longest audio accepted).
    samples = numpy.frombuffer(raw, "<f4" if payload.dtype == "float32" else "<f8")
    pcm = numpy.empty(len(samples), "<i2")
    block = numpy.empty(min(len(samples), AUDIO_BLOCK), numpy.float64)
    for start in range(0, len(samples), AUDIO_BLOCK):
        part = samples[start:start + AUDIO_BLOCK]
        floats = block[:len(part)]
        floats[...] = part
        numpy.nan_to_num(floats, copy=False, nan=0.0)
        numpy.clip(floats, -1.0, 1.0, out=floats)
        floats *= 32767.0
        pcm[start:start + len(part)] = floats  # truncates toward zero, as astype does
    return Audio(pcm.tobytes(), rate, channels)


def join_audio(chunks: list[Audio], max_seconds: float | None = None) -> Audio:
    if not chunks:
        return Audio(b"", DEFAULT_SAMPLE_RATE, 1)
    first = chunks[0]
    for c in chunks[1:]:
        if (c.sample_rate, c.channels) != (first.sample_rate, first.channels):
            raise MediaError(f"audio chunks disagree: {first.sample_rate} Hz x {first.channels} then "
                             f"{c.sample_rate} Hz x {c.channels}")
    seconds = sum(len(c.pcm) for c in chunks) / (2 * first.channels * first.sample_rate)
    if max_seconds is not None and seconds > max_seconds:
        raise MediaError(f"{seconds:.1f}s of audio is more than the {max_seconds:g}s the master encodes")
    return Audio(b"".join(c.pcm for c in chunks), first.sample_rate, first.channels)


def wav(audio: Audio) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(audio.channels)
        w.setsampwidth(2)
        w.setframerate(audio.sample_rate)
        w.writeframes(audio.pcm)
    return buf.getvalue()


# Encoded audio formats the API offers: name -> content type.
AUDIO_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}


def encode_audio(audio: Audio, fmt: str) -> bytes:
    """The audio as a file of one of AUDIO_TYPES."""
    if fmt == "wav":
        return wav(audio)
    if fmt not in AUDIO_TYPES:
        raise MediaError(f"no encoder for {fmt!r}")
    import numpy
    import soundfile

    samples = numpy.frombuffer(audio.pcm, dtype="<i2").reshape(-1, audio.channels)
    buf = io.BytesIO()
    soundfile.write(buf, samples, audio.sample_rate, format=fmt.upper(), subtype="PCM_16" if fmt == "flac" else None)
    return buf.getvalue()
