"""Chat content parts with images, audio and video: decoded once by the master, bounded, for the entry stage only."""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

from fleet_harness import pipeline, stage

from ..conftest import mp4 as video


def png(width: int, height: int, rgb=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(buf, format="PNG")
    return buf.getvalue()


def wav(samples: list[int], rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(struct.pack(f"<{len(samples)}h", *samples))
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def chat(fleet, parts: list[dict]) -> tuple[int, dict]:
    return fleet.http("POST", "/v1/chat/completions", {"model": "test", "messages": [
        {"role": "system", "content": "look and listen"}, {"role": "user", "content": parts}]})


def media_fleet(make_fleet, **master):
    fleet = make_fleet(pipeline(stage("see", "media_entry"),
                                stage("tell", "media_next", inputs=["see"], finalOutput="text")))
    if master:
        fleet.config.write_text(fleet.config.read_text().replace(
            "spec:\n", "spec:\n  master: " + json.dumps(master) + "\n", 1))
    fleet.start_master()
    fleet.start_pod("pod-see", "see")
    fleet.start_pod("pod-tell", "tell")
    fleet.wait_ready()
    return fleet


def test_images_and_audio_reach_the_entry_stage_decoded_and_the_next_stage_without_the_bytes(make_fleet):
    fleet = media_fleet(make_fleet)
    samples = [16384, -16384] * 800  # 0.1 s at 16 kHz
    status, body = chat(fleet, [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": data_url(png(3, 2))}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(samples)).decode(), "format": "wav"}},
    ])
    assert status == 200, body
    got = json.loads(body["choices"][0]["message"]["content"])
    assert got["entry"] == [
        {"type": "text"},
        {"type": "image", "shape": [2, 3, 3], "dtype": "uint8", "first_pixel": [255, 0, 0]},
        {"type": "audio", "shape": [1600], "sample_rate": 16000, "first_sample": 0.5, "bytes": 6400},
    ]
    # The next stage learns what the request held, not the bytes (they went to the entry stage only).
    assert got["next"] == [
        {"type": "text"},
        {"type": "image", "shape": [2, 3, 3], "dtype": "uint8", "first_pixel": None},
        {"type": "audio", "shape": [1600], "sample_rate": 16000, "first_sample": None, "bytes": None},
    ]


def test_a_video_reaches_the_entry_stage_as_the_frames_vllm_would_take(make_fleet):
    """40 frames, 32 taken (maxVideoFrames' default, vLLM's num_frames) evenly as vLLM's loader takes them;
    test_llm_media compares the frames themselves with vLLM's loader."""
    fleet = media_fleet(make_fleet)
    status, body = chat(fleet, [{"type": "video_url", "video_url": {"url": data_url(video(40), "video/mp4")}}])
    assert status == 200, body
    [entry] = json.loads(body["choices"][0]["message"]["content"])["entry"]
    taken = [int(i) for i in __import__("numpy").linspace(0, 39, 32, dtype=int)]
    assert entry == {"type": "video", "shape": [32, 8, 16, 3], "dtype": "uint8", "fps": 4.0, "total_frames": 40,
                     "frame_indices": taken, "bytes": 32 * 8 * 16 * 3}
    [later] = json.loads(body["choices"][0]["message"]["content"])["next"]
    assert later["bytes"] is None and later["shape"] == [32, 8, 16, 3]
    # The bound on the decoded frames: fewer frames pass where more would not.
    fleet2 = media_fleet(make_fleet, limits={"maxVideoPixels": 8 * 16 * 10})
    status, body = chat(fleet2, [{"type": "video_url", "video_url": {"url": data_url(video(40), "video/mp4")}}])
    assert status == 400 and "32 frames of 16x8 are more than 1280 pixels (spec.master.limits.maxVideoPixels" \
        in body["error"]["message"], body
    fleet3 = media_fleet(make_fleet, limits={"maxVideoPixels": 8 * 16 * 10, "maxVideoFrames": 10})
    status, body = chat(fleet3, [{"type": "video_url", "video_url": {"url": data_url(video(40), "video/mp4")}}])
    assert status == 200, body
    [entry] = json.loads(body["choices"][0]["message"]["content"])["entry"]
    assert entry["shape"] == [10, 8, 16, 3] and entry["frame_indices"] == [0, 4, 8, 13, 17, 21, 26, 30, 34, 39]


def test_media_parts_the_master_cannot_take_are_400s_naming_the_part(make_fleet):
    fleet = media_fleet(make_fleet, limits={"maxImagePixels": 100, "maxInputAudioSeconds": 1})
    cases = [
        ({"type": "image_url", "image_url": {"url": data_url(png(20, 10))}},
         "'messages[1].content[0]': an image of 20x10 is more than 100 pixels (spec.master.limits.maxImagePixels)"),
        ({"type": "image_url", "image_url": {"url": data_url(b"not an image")}},
         "'messages[1].content[0]': not an image the master can read"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
         "'messages[1].content[0].image_url.url' is not valid base64"),
        ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}},
         "the master fetches no URL of host '127.0.0.1'"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav([0] * 32000)).decode(), "format": "wav"}},
         "'messages[1].content[0]': 2.0 s of audio is more than 1 s (spec.master.limits.maxInputAudioSeconds)"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....").decode(), "format": "wav"}},
         "'messages[1].content[0].input_audio': not wav audio the master can read"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}},
         "'messages[1].content[0].input_audio.format' must be one of wav, flac, mp3, ogg"),
        ({"type": "video_url", "video_url": {"url": data_url(b"not a video", "video/mp4")}},
         "'messages[1].content[0]': not a video the master can read"),
        ({"type": "video_url", "video_url": {"url": data_url(png(2, 2))}},
         "'messages[1].content[0].video_url.url' is not a base64 data URL of a video"),
        ({"type": "video_url", "video_url": {"url": data_url(video(2, 16, 8), "video/mp4")}},
         "'messages[1].content[0]': video frames of 16x8 are more than 100 pixels (spec.master.limits.maxImagePixels)"),
        ({"type": "file", "file": {}}, "'messages[1].content[0]': content parts of type 'file' are not accepted"),
    ]
    for part, message in cases:
        status, body = chat(fleet, [part])
        assert status == 400 and message in body["error"]["message"], (part, body)
    assert fleet.get("/health")[0] == 200
    # A photo's base64 is not prompt text: a 10 x 10 noise PNG past maxPromptChars is judged by its pixels.
    noisy = Image.frombytes("RGB", (10, 10), bytes(range(256)) + bytes(44))
    buf = io.BytesIO()
    noisy.save(buf, format="PNG")
    fleet2 = media_fleet(make_fleet, limits={"maxPromptChars": 64})
    status, body = chat(fleet2, [{"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}}])
    assert status == 200, body


class _Images(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        raw = png(4, 4, (0, 255, 0))
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def test_an_allowed_host_is_fetched_by_the_master(make_fleet):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fleet = media_fleet(make_fleet, mediaUrlHosts=["127.0.0.1"])
        status, body = chat(fleet, [{"type": "image_url",
                                     "image_url": {"url": f"http://127.0.0.1:{server.server_port}/a.png"}}])
        assert status == 200, body
        got = json.loads(body["choices"][0]["message"]["content"])
        assert got["entry"] == [{"type": "image", "shape": [4, 4, 3], "dtype": "uint8", "first_pixel": [0, 255, 0]}]
    finally:
        server.shutdown()


def test_speech_comes_as_wav_flac_or_mp3_and_chat_audio_too(make_fleet):
    import soundfile
    import urllib.request

    fleet = make_fleet(pipeline(stage("text", "upper"), stage("voice", "tone", inputs=["text"], finalOutput="audio")))
    fleet.start_master()
    fleet.start_pod("pod-t", "text")
    fleet.start_pod("pod-v", "voice")
    fleet.wait_ready()

    def speech(fmt: str) -> tuple[str, bytes]:
        req = urllib.request.Request(f"{fleet.url}/v1/audio/speech", data=json.dumps(
            {"model": "test", "input": "hi", "response_format": fmt}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.headers["Content-Type"], resp.read()

    decoded = {}
    for fmt, ctype in (("wav", "audio/wav"), ("flac", "audio/flac"), ("mp3", "audio/mpeg")):
        got_type, raw = speech(fmt)
        assert got_type == ctype, (fmt, got_type)
        decoded[fmt], rate = soundfile.read(io.BytesIO(raw), dtype="int16")
        assert rate == 8000, (fmt, rate)
    assert len(decoded["wav"]) == 8000  # the tone stage's second of audio
    assert (decoded["flac"] == decoded["wav"]).all()  # lossless: the same 16-bit samples
    assert len(decoded["mp3"]) >= 8000  # lossy, padded to whole frames
    status, body = fleet.http("POST", "/v1/audio/speech", {"model": "test", "input": "hi", "response_format": "aac"})
    assert status == 400 and "use one of pcm, wav, flac, mp3" in body["error"]["message"]

    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "test", "modalities": ["audio"], "audio": {"format": "flac"},
        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(body["choices"][0]["message"]["audio"]["data"])),
                                   dtype="int16")
    assert rate == 8000 and (samples == decoded["wav"]).all()
