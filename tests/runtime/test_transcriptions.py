"""/v1/audio/transcriptions through OpenAI's own client: the file reaches the entry stage decoded, as a chat
message's audio part with the instruction, and the text outputs come back as the transcript (json, text, SSE)."""

from __future__ import annotations

import io
import json
import urllib.request
import uuid

import openai
import pytest
import soundfile

from fleet_harness import pipeline, stage

from .test_chat_media import wav

SAMPLES = [16384, -16384] * 800  # 0.1 s at 16 kHz; the first sample decodes to 0.5


@pytest.fixture
def fleet(make_fleet):
    fleet = make_fleet(pipeline(stage("hear", "hear", finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-hear", "hear")
    fleet.wait_ready()
    return fleet


def flac(samples: list[int], rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, [s / 32768 for s in samples], rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def test_a_transcription_is_the_text_the_entry_stage_makes_of_the_audio(fleet):
    client = fleet.openai()
    got = client.audio.transcriptions.create(model="test", file=("talk.wav", wav(SAMPLES)), language="en",
                                             prompt="Names: Ada.", temperature=0.25)
    want = ("1600 samples at 16000 Hz, first 0.5 | Transcribe the audio; its language: en.\nNames: Ada. "
            "| temperature 0.25")
    assert got.text == want
    assert got.usage.type == "tokens" and got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    # FLAC, told apart by its bytes (whatever the file is called), and the bare instruction.
    text = client.audio.transcriptions.create(model="test", file=("upload.bin", flac(SAMPLES, 8000)),
                                              response_format="text")
    assert text.strip() == "1600 samples at 8000 Hz, first 0.5 | Transcribe the audio. | temperature None"
    # Streamed: OpenAI's transcript events, the deltas as the stage makes them, then the whole text.
    events = list(client.audio.transcriptions.create(model="test", file=("talk.wav", wav(SAMPLES)), stream=True))
    assert [e.type for e in events] == ["transcript.text.delta", "transcript.text.delta", "transcript.text.done"]
    assert events[0].delta == "1600 samples at 16000 Hz, first 0.5"
    assert "".join(e.delta for e in events[:2]) == events[2].text
    assert events[2].text.endswith("| Transcribe the audio. | temperature None")


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = b""
    for k, v in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
    for k, (name, data) in files.items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{name}"\r\n'
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def post_form(fleet, fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[int, dict]:
    data, ctype = multipart(fields, files)
    req = urllib.request.Request(f"{fleet.url}/v1/audio/transcriptions", data=data, method="POST",
                                 headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("fields, files, status, fragment", [
    ({"model": "test"}, {}, 400, "'file' is required"),
    ({}, {"file": ("a.wav", b"RIFF but not a wave file")}, 400, "not wav audio the master can read"),
    ({}, {"file": ("a.txt", b"hello")}, 400, "'file' ('a.txt') is not wav, flac, mp3 or ogg audio"),
    ({"response_format": "srt"}, {"file": ("a.wav", wav(SAMPLES))}, 400, "response_format 'srt' is not supported"),
    ({"timestamp_granularities[]": "word"}, {"file": ("a.wav", wav(SAMPLES))}, 400,
     "unknown field 'timestamp_granularities[]'"),
    ({"language": "english"}, {"file": ("a.wav", wav(SAMPLES))}, 400, "'language' must be an ISO-639-1 code"),
    ({"temperature": "nan"}, {"file": ("a.wav", wav(SAMPLES))}, 400, "'temperature' must be a number"),
    ({"stream": "yes"}, {"file": ("a.wav", wav(SAMPLES))}, 400, "'stream' must be true or false"),
    ({"prompt": "x" * 1_000_001}, {"file": ("a.wav", wav(SAMPLES))}, 400, "spec.master.limits.maxPromptChars"),
    ({}, {"file": ("a.wav", wav(SAMPLES)), "prompt": ("p.txt", b"a file")}, 400, "'prompt' must be a form field"),
    ({"model": "whisper-1"}, {"file": ("a.wav", wav(SAMPLES))}, 404, "model 'whisper-1' is not served here"),
])
def test_bad_forms_are_refused_naming_the_field(fleet, fields, files, status, fragment):
    got_status, body = post_form(fleet, fields, files)
    assert (got_status, fragment in body["error"]["message"]) == (status, True), body


def test_a_pipeline_without_text_output_refuses_transcriptions(make_fleet):
    fleet = make_fleet(pipeline(stage("hear", "hear", finalOutput="audio")))
    fleet.start_master()
    fleet.start_pod("pod-hear", "hear")
    fleet.wait_ready()
    with pytest.raises(openai.BadRequestError, match="this pipeline has no text output"):
        fleet.openai().audio.transcriptions.create(model="test", file=("a.wav", wav(SAMPLES)))
