"""Image, audio and video input to an `llm` stage: stock vLLM running the tiny Qwen2.5-Omni's thinker.

The model is the tiny seeded Qwen2.5-Omni of the vllm-omni tests (devsetup.tiny_omni, built here with
this environment's transformers, its multimodal processor included); stock vLLM runs its thinker (vLLM's
registry has Qwen2.5-Omni's thinker, not its talker or code2wav). One `llm` stage, allowed an image, an
audio and a video per prompt, behind the master. A chat message with a PNG, a WAV and a question, and one
with an MP4 and a question, go through the master, which decodes the media once; the stage renders the
model's chat template and hands the pixels, samples and frames to its engine as vLLM's multimodal data.

The oracle is vLLM's own `LLM.chat` on the same checkpoint and engine settings, in a process of its own,
given the messages as the client sent them (vLLM decodes the PNG, the WAV and the MP4 itself,
llm_media_oracle.py). Greedy: the tokens through omnifleet must equal the oracle's, and the prompt the
engine ran (usage.prompt_tokens) must be the oracle's, placeholders expanded to the media's length.
The prompt length and the vllm-omni tests' hidden states (equal to vLLM-Omni's for the same media) are
the sharper checks of the media's path.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from fleet_harness import Fleet, pipeline  # noqa: E402

from ..conftest import mp4, time_limit  # noqa: E402
from .conftest import HEARTBEAT, HERE, end, engine_env, media, report, run_in_group, tiny_omni_path  # noqa: E402

pytestmark = [pytest.mark.vllm]
TEST_TIMEOUT_S = 900

ENGINE = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 1, "enforce_eager": True,
          "enable_prefix_caching": False, "limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 1},
          "seed": 0}
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "repetition_penalty": 1.1}  # vLLM-Omni's thinker settings


CLIP_FRAMES = 40  # 10 s: more than the default loader's 32 frames and Qwen2-VL's loader's 2 a second


def transcription_message() -> list:
    """What /v1/audio/transcriptions makes of media()'s WAV with language=en: the message vLLM's LLM.chat gets."""
    wav = media()[0][0]["content"][1]
    return [{"role": "user", "content": [wav, {"type": "text", "text": "Transcribe the audio; its language: en."}]}]


def video_message() -> list:
    import base64

    url = "data:video/mp4;base64," + base64.b64encode(mp4(CLIP_FRAMES, 56, 56)).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "what happens?"}]}]


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def tiny_omni() -> str:
    path = tiny_omni_path()
    # Without its multimodal processor the checkpoint takes text only (tiny_omni saves it when torchvision loads).
    assert (Path(path) / "processor_config.json").exists(), f"{path} has no multimodal processor"
    return path


@pytest.fixture(scope="module")
def oracle_run(tiny_omni, tmp_path_factory):
    """vLLM's own LLM.chat on the requests, started beside the fleet (not waited for: the oracle fixture waits)."""
    tmp = tmp_path_factory.mktemp("llm-media-oracle")
    (tmp / "request.json").write_text(json.dumps({"engine": ENGINE, "requests": [media()[0], video_message(),
                                                                               transcription_message()],
                                                  "sampling_params": SAMPLING}))
    proc = run_in_group([sys.executable, str(HERE / "llm_media_oracle.py"), tiny_omni, str(tmp / "request.json"),
                         str(tmp / "out.json")], tmp, tmp / "oracle.log", engine_env())
    yield proc, tmp, time.monotonic()
    end(proc, None)


@pytest.fixture(scope="module")
def fleet_run(tiny_omni, tmp_path_factory):
    """The fleet's master and thinker pod, started beside the oracle (the fleet fixture waits)."""
    d = pipeline({"name": "thinker", "type": "llm", "gpus": 0, "model": tiny_omni, "engineArgs": ENGINE,
                  "samplingParams": SAMPLING, "finalOutput": "text"}, name="omni-thinker")
    d["spec"]["heartbeat"] = HEARTBEAT
    f = Fleet(tmp_path_factory.mktemp("llm-media"), d)
    f.env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    try:
        f.start_master()
        f.start_pod("thinker-0", "thinker")
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def oracle(launched, request) -> dict:
    (proc, tmp, t), _ = launched
    end(proc, 900)  # the engine's processes go with its group
    assert proc.returncode == 0 and (tmp / "out.json").exists(), \
        (tmp / "oracle.log").read_text(errors="replace")[-6000:]
    report(request.config, "llm-media", f"oracle (vLLM's LLM.chat, beside the fleet): {time.monotonic() - t:.1f}s")
    image_audio, video, transcription = json.loads((tmp / "out.json").read_text())
    return {**image_audio, "video": video, "transcription": transcription}


@pytest.fixture(scope="module")
def fleet(launched):
    _, f = launched
    try:
        f.wait_ready(timeout=900)
    except BaseException:
        print(f.logs()[-20000:])
        raise
    return f


def test_image_and_audio_reach_the_thinker_as_vllm_takes_them(fleet, oracle, request):
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni-thinker", "messages": media()[0], "return_token_ids": True})
    took = time.monotonic() - t
    assert status == 200, body
    assert oracle["token_ids"], oracle
    assert body["choices"][0]["token_ids"] == oracle["token_ids"]
    assert body["usage"]["prompt_tokens"] == len(oracle["prompt_token_ids"]), (body["usage"], oracle)
    # The media took their expanded length in the prompt (the image 4 tokens, the second of audio 25).
    status, plain = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni-thinker", "messages": [{"role": "user", "content": "what is this?"}]})
    assert status == 200, plain
    grown = body["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert grown > 6 + 20, f"the media added only {grown} prompt tokens"
    report(request.config, "llm-media", f"PNG + WAV + text through omnifleet to stock vLLM: {took:.2f}s; prompt "
           f"{body['usage']['prompt_tokens']} tokens ({grown} for the media), tokens {oracle['token_ids']} as "
           f"vLLM's own LLM.chat")


def test_a_transcription_runs_the_thinker_as_vllm_s_chat_with_the_audio_and_the_instruction(fleet, oracle):
    """OpenAI's client posts the WAV as a file; the thinker runs the prompt vLLM's LLM.chat runs for the audio
    part and the instruction the master writes, and the transcript is vLLM's answer."""
    import base64

    want = oracle["transcription"]
    wav = base64.b64decode(transcription_message()[0]["content"][0]["input_audio"]["data"])
    got = fleet.openai(timeout=300).audio.transcriptions.create(model="omni-thinker", file=("tone.wav", wav),
                                                                language="en")
    assert want["token_ids"] and got.text == want["text"], (got, want)
    assert (got.usage.input_tokens, got.usage.output_tokens) == (len(want["prompt_token_ids"]),
                                                                 len(want["token_ids"])), (got.usage, want)


def test_the_master_takes_the_frames_vllm_s_own_loader_takes():
    """The master's decoder against vLLM's OpenCV video loader (what vLLM's OpenAI server runs), on the same
    MP4: the same frames, byte for byte, and the same indices, fps and frame count."""
    import numpy as np
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    from omnifleet_runtime.content import decode_video

    for frames in (8, CLIP_FRAMES):
        raw = mp4(frames, 56, 40)
        ours = decode_video(raw, "messages[0].content[0]", 1 << 24, 32, 1 << 30)
        theirs, meta = VIDEO_LOADER_REGISTRY.load("opencv").load_bytes(raw, num_frames=32)
        got = np.frombuffer(ours["video"]["data"], np.uint8).reshape(ours["video"]["shape"])
        assert got.shape == theirs.shape == (min(frames, 32), 40, 56, 3)
        assert np.array_equal(got, theirs)
        assert (ours["frame_indices"], ours["total_frames"], ours["fps"]) == \
            (meta["frames_indices"], meta["total_num_frames"], meta["fps"])


def test_a_video_reaches_the_thinker_as_vllm_takes_it(fleet, oracle, request):
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni-thinker", "messages": video_message(), "return_token_ids": True})
    assert status == 200, body
    want = oracle["video"]
    assert body["choices"][0]["token_ids"] == want["token_ids"]
    assert body["usage"]["prompt_tokens"] == len(want["prompt_token_ids"]), (body["usage"], want)
    status, plain = fleet.http("POST", "/v1/chat/completions", {
        "model": "omni-thinker", "messages": [{"role": "user", "content": "what happens?"}]})
    assert status == 200, plain
    grown = body["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert grown > 16, f"the video added only {grown} prompt tokens"
    report(request.config, "llm-media", f"MP4 ({CLIP_FRAMES} frames) + text through omnifleet to stock vLLM: prompt "
           f"{body['usage']['prompt_tokens']} tokens ({grown} for the video), as vLLM's own LLM.chat")


def test_a_part_the_stage_cannot_take_is_a_clear_400(fleet):
    """Two images to an engine allowed one per prompt: vLLM refuses the prompt, and the client gets that as
    its own fault (400 naming the images), not as the stage's failure."""
    sent = media()[0]
    sent[0]["content"] = [sent[0]["content"][0], sent[0]["content"][0]]  # two images; the engine allows one
    status, body = fleet.http("POST", "/v1/chat/completions", {"model": "omni-thinker", "messages": sent})
    assert status == 400, (status, body)
    assert "image" in body["error"]["message"], body
