"""Qwen3-Omni in vLLM-Omni's async-chunk mode (its deploy file's default), through omnifleet's master and
three `vllm-omni` stage pods, against vLLM-Omni's own single-process engine in the same mode.

In async-chunk mode the stages stream: the talker starts once the thinker has
its first token and takes one thinker token a step; code2wav vocodes the
talker's codec frames in chunks (the deploy file's: the first 4 frames, then
25 at a time, each with up to 25 frames of left context) as they come. In
omnifleet the stage engines' connector payloads cross pods on the wire
(`inputMode: stream`), and the audio reaches the client chunk by chunk.

The tiny seeded checkpoint and the CPU deploy settings are test_vllm_omni_qwen3's, but for the thinker's
dtype: bfloat16 here, as the deploy file runs it on GPUs (the talker's bfloat16 projection takes the
thinker's rows as they come in this mode; float32 rows fail: "mat1 and mat2 must have the same dtype").
"""

from __future__ import annotations

import base64
import math
from array import array

import pytest

from ..conftest import time_limit  # noqa: E402
from .conftest import media, report  # noqa: E402
from .test_vllm_omni import omni_pipeline, omni_python, ready, start_fleet  # noqa: E402,F401
from .test_vllm_omni_qwen3 import (SAMPLING, STAGES, TEST_TIMEOUT_S, check_voice,  # noqa: E402
                                   complete_like_oracle, oracle_requests, run_oracle)
from .test_vllm_omni_qwen3 import tiny_qwen3_omni  # noqa: E402,F401

pytestmark = [pytest.mark.vllm]

# The qwen3_omni_moe deploy file's connector settings: code2wav's chunks of codec frames.
CHUNKS = {"initial_codec_chunk_frames": 4, "codec_chunk_frames": 25, "codec_left_context_frames": 25}
CONNECTOR = {"name": "SharedMemoryConnector", "extra": CHUNKS}
ASYNC_STAGES = [
    {**s, "async": True, "engine": {**s["engine"], "dtype": "bfloat16"} if s["stageId"] == 0 else s["engine"],
     "stage_config": {"extras": {"input_connectors": {f"from_stage_{s['stageId'] - 1}": "shm"}},
                      "connectors": {"shm": CONNECTOR}} if s["stageId"] else {}}
    for s in STAGES]


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def oracle_run(omni_python, tiny_qwen3_omni, tmp_path_factory):
    """vLLM-Omni's own engine in async-chunk mode on the four requests, started (not waited for)."""
    yield from run_oracle(tmp_path_factory.mktemp("oracle-async"), omni_python, tiny_qwen3_omni, {
        "async_chunk": True, "connectors": {"shm": CONNECTOR},
        "stages": [{"stage_id": s["stageId"], "devices": "0", **s["engine"], "default_sampling_params": s["sampling"],
                    **({"input_connectors": {f"from_stage_{s['stageId'] - 1}": "shm"}} if s["stageId"] else {})}
                   for s in ASYNC_STAGES]})


@pytest.fixture(scope="module")
def oracle(launched, request) -> list[dict]:
    return oracle_requests(launched, request, "vllm-omni-qwen3-async", "async-chunk mode, 3 stages")


@pytest.fixture(scope="module")
def fleet_run(omni_python, tiny_qwen3_omni, tmp_path_factory):
    d = omni_pipeline("qwen3-omni", tiny_qwen3_omni, "qwen3_omni_moe", ASYNC_STAGES)
    # The stages run at once, and a stage engine's worker that waits for chunks spins on its core (vLLM's
    # queue's busy loop, yielding the core); with a pod to a session, each a scheduling autogroup of its own,
    # that starved the others' workers on the same core. Here they share the test's, as the oracle's do.
    yield from start_fleet(tmp_path_factory.mktemp("qwen3-async-fleet"), d, omni_python, one_session=True)


@pytest.fixture(scope="module")
def fleet(launched, request):
    return ready(launched, request, "vllm-omni-qwen3-async")


def test_vllm_omni_runs_a_tiny_qwen3_omni_in_async_chunk_mode_on_the_cpu(oracle, request):
    first, second = oracle[:2]
    assert len(first["thinker_token_ids"]) == SAMPLING[0]["max_tokens"], first
    assert second["thinker_token_ids"] == first["thinker_token_ids"], (first, second)
    audio = first["audio"]
    assert len(audio) == first["audio_samples"] > 0 and all(map(math.isfinite, audio)), first
    assert max(map(abs, audio)) > 0, "silence"
    report(request.config, "vllm-omni-qwen3-async", f"vLLM-Omni's Omni, async-chunk mode: thinker tokens "
           f"{first['thinker_token_ids']}, {first['audio_samples']} and {second['audio_samples']} audio samples")


def test_qwen3_omni_streams_through_omnifleet_as_vllm_omnis_own_engine(fleet, oracle, request):
    """The oracle's two text requests, in its order, as completions of its prompt tokens with
    `modalities: ["text", "audio"]`: the thinker's tokens, and code2wav's audio as it left code2wav, in more
    than one chunk (float32 samples, joined here in order)."""
    for i, want in enumerate(oracle[:2]):
        choice, sizes, took, peak, worst = complete_like_oracle(fleet, want, i)
        assert sum(1 for n in sizes if n) > 1, f"request {i}: the audio came in one chunk ({sizes})"
        report(request.config, "vllm-omni-qwen3-async", f"request {i} through omnifleet (3 stage pods, "
               f"streaming): {took:.2f}s; thinker tokens {choice['token_ids']}, {sum(sizes)} float32 samples in "
               f"chunks of {sizes} (peak {peak:.3g}; largest difference from vLLM-Omni's own engine: {worst:.3g})")


def test_qwen3_omni_async_image_and_audio_in_text_and_audio_out(fleet, oracle, request):
    """The oracle's third request, a chat message with a PNG, a WAV and a question: the thinker's tokens,
    its expanded prompt's length (which sizes the talker's placeholder prompt) and the audio's length."""
    want = oracle[2]
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "qwen3-omni", "messages": media()[0], "return_token_ids": True,
        "modalities": ["text", "audio"], "audio": {"format": "pcm16"}}, timeout=600)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == want["thinker_token_ids"], (choice["token_ids"], want)
    assert body["usage"]["prompt_tokens"] == len(want["thinker_prompt_token_ids"]), body["usage"]
    got = array("h", base64.b64decode(choice["message"]["audio"]["data"]))
    assert want["audio_samples"] > 0 and len(got) == want["audio_samples"], (len(got), want["audio_samples"])
    report(request.config, "vllm-omni-qwen3-async", f"image + audio + text in, streamed text and audio out: "
           f"prompt {body['usage']['prompt_tokens']} tokens, thinker tokens {choice['token_ids']}, {len(got)} "
           f"samples of audio, as vLLM-Omni's own engine's")


def test_qwen3_omni_streams_in_the_requested_voice(fleet, oracle, request):
    """The voice reaches the talker on the thinker's chunks (its async-chunk builder reads it from the
    thinker's request), in more than one chunk of audio."""
    _, sizes, *_ = check_voice(fleet, oracle, request, "vllm-omni-qwen3-async")
    assert sum(1 for n in sizes if n) > 1, sizes
