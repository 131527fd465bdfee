"""vLLM-Omni's engines on a tiny Qwen3-Omni on the CPU, alone and as omnifleet stages: the MoE thinker, the MoE
talker with its code predictor, code2wav, in vLLM-Omni's whole-output mode (`async_chunk: false`).

The oracle is vLLM-Omni's single-process `Omni` engine (tests/engines/vllm_omni_oracle.py), all three stages on
the CPU through omnifleet's platform plugin (plugins/omnifleet-vllm-omni-cpu), on the tiny checkpoint that
tests/engines/tiny_qwen3_omni.py makes, with vLLM-Omni's Qwen3-Omni deploy settings made CPU-sized (float32 but
the talker, eager, no CUDA graphs, the MoE backend vLLM picks). The fleet is the same three stages as
`vllm-omni` stages, a pod process each (vLLM-Omni's environment, a device lock of its own as a pod's /tmp
gives it), behind omnifleet's master, started beside the oracle. Both take the same four requests in the same
order: a text request twice, a chat message with an image and audio (which the master decodes and the
thinker's engine takes as multimodal data), then the text request in another voice than the model's default;
the fleet's thinker tokens and audio must be the oracle's.

The same request twice does not give the same audio: the talker draws its first codebook with the request's
seed (the deploy file's), but its code predictor draws the other codebooks from the engine's global generator,
so the second request's codes part from the first's (the report says from which sample). That generator starts
from the same state in every fresh engine process, and the talker's engine runs the same requests in the same
order in both: so the fleet's second request is compared with the oracle's second too.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import time
from array import array
from pathlib import Path

import pytest
import yaml

from ..conftest import time_limit  # noqa: E402
from .conftest import HERE, end, media, report, run_in_group  # noqa: E402
# omni_python: a fixture (vLLM-Omni's python)
from .test_vllm_omni import _env, omni_pipeline, omni_python, ready, start_fleet  # noqa: E402,F401

pytestmark = [pytest.mark.vllm]
TEST_TIMEOUT_S = 2400  # the first test waits for the oracle, which starts beside the fleet on two cores
RUN_TIMEOUT_S = 1800  # the oracle's engine start (about 2.5 min alone on two cores), beside the fleet's

ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 2048, "max_num_seqs": 1,
          "enforce_eager": True, "moe_backend": "auto", "max_cudagraph_capture_size": 0,
          "trust_remote_code": True, "enable_prefix_caching": False}
# vLLM-Omni's qwen3_omni_moe deploy file's sampling (its talker's seed included), the lengths made small.
SAMPLING = [
    {"temperature": 0.0, "max_tokens": 6, "seed": 42},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 16, "seed": 42, "repetition_penalty": 1.05},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "repetition_penalty": 1.1},
]
# The talker in bfloat16: vLLM-Omni's Qwen3-Omni talker makes its input rows in bfloat16 whatever the model's
# dtype (float32 fails: "mat1 and mat2 must have the same dtype").
STAGES = [
    dict(name="thinker", stageId=0, modelStage="thinker", workerType="ar", final="text", sampling=SAMPLING[0],
         engine={**ENGINE, "mm_processor_cache_gb": 0}),
    dict(name="talker", stageId=1, modelStage="talker", workerType="ar", final=None, sampling=SAMPLING[1],
         engine={**ENGINE, "dtype": "bfloat16"}),
    dict(name="code2wav", stageId=2, modelStage="code2wav", workerType="generation", final="audio",
         sampling=SAMPLING[2], engine={**ENGINE, "enable_chunked_prefill": False, "async_scheduling": False}),
]
MESSAGES = [{"role": "user", "content": "hi"}]
# The fourth request's voice: one of the tiny model's three (talker_config.speaker_id), not its default (the
# first in its config.json, which transformers writes sorted: aiden); as a client might spell it.
VOICE = "Ethan"


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def tiny_qwen3_omni(omni_python) -> str:
    proc = subprocess.run([omni_python, str(HERE / "tiny_qwen3_omni.py"), "--print-path"],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def run_oracle(tmp: Path, omni_python: str, model: str, deploy: dict):
    """A module's oracle_run body: vLLM-Omni's own engine with `deploy` on the module's four requests, in the
    fleet's order (the text request twice, the one with an image and audio, the text request in VOICE),
    started (not waited for)."""
    (tmp / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    (tmp / "request.json").write_text(json.dumps({"prompts": [MESSAGES, MESSAGES, media()[1], MESSAGES],
                                                  "speakers": [None, None, None, VOICE],
                                                  "sampling_params": SAMPLING}))
    proc = run_in_group([omni_python, str(HERE / "vllm_omni_oracle.py"), model, str(tmp / "deploy.yaml"),
                         str(tmp / "request.json"), str(tmp)], tmp, tmp / "omni.log", _env())
    yield proc, tmp, time.monotonic()
    end(proc, None)


def oracle_requests(launched, request, tag: str, what: str) -> list[dict]:
    """A module's oracle fixture body: waits for the oracle and reads its requests' results and audio."""
    (proc, tmp, t), _ = launched
    end(proc, RUN_TIMEOUT_S)  # the oracle ends with os._exit; the group's engine processes go with it
    log = (tmp / "omni.log").read_text(errors="replace")
    assert proc.returncode == 0 and (tmp / "result.json").exists(), log[-6000:]
    result = json.loads((tmp / "result.json").read_text())
    for i, one in enumerate(result["requests"]):
        one["audio"] = array("f", (tmp / f"audio.{i}.f32").read_bytes())
    report(request.config, tag, f"oracle (vLLM-Omni's Omni, {what}, beside the fleet): engine start "
           f"{result['start_s']:.1f}s, total {time.monotonic() - t:.1f}s")
    return result["requests"]


@pytest.fixture(scope="module")
def oracle_run(omni_python, tiny_qwen3_omni, tmp_path_factory):
    """vLLM-Omni's own engine on the four requests, started (not waited for): the oracle fixture waits."""
    yield from run_oracle(tmp_path_factory.mktemp("oracle"), omni_python, tiny_qwen3_omni, {
        "async_chunk": False, "stages": [{"stage_id": i, "devices": "0", **s["engine"],
                                          "default_sampling_params": SAMPLING[i]} for i, s in enumerate(STAGES)]})


@pytest.fixture(scope="module")
def oracle(launched, request) -> list[dict]:
    return oracle_requests(launched, request, "vllm-omni-qwen3", "3 stages")


def doc(model: str) -> dict:
    return omni_pipeline("qwen3-omni", model, "qwen3_omni_moe", STAGES)


@pytest.fixture(scope="module")
def fleet_run(omni_python, tiny_qwen3_omni, tmp_path_factory):
    """The fleet's master and stage pods, started (not waited for): the fleet fixture waits."""
    yield from start_fleet(tmp_path_factory.mktemp("qwen3-fleet"), doc(tiny_qwen3_omni), omni_python)


@pytest.fixture(scope="module")
def fleet(launched, request):
    return ready(launched, request, "vllm-omni-qwen3")


def test_vllm_omni_runs_a_tiny_qwen3_omni_on_the_cpu(oracle, request):
    first, second = oracle[:2]
    assert len(first["thinker_token_ids"]) == SAMPLING[0]["max_tokens"], first
    assert first["thinker_hidden_shape"][0] > 0 and first["sample_rate"] == 24000, first
    audio = [one["audio"] for one in oracle[:2]]
    assert len(audio[0]) == first["audio_samples"] > 0 and all(map(math.isfinite, audio[0])), first
    assert max(map(abs, audio[0])) > 0, "silence"
    assert second["thinker_token_ids"] == first["thinker_token_ids"], (first, second)
    assert len(audio[1]) == len(audio[0]), (first, second)
    same = next((i for i, (x, y) in enumerate(zip(*audio)) if x != y), len(audio[0]))
    report(request.config, "vllm-omni-qwen3", f"vLLM-Omni's Omni on a tiny Qwen3-Omni (3 stages, CPU): thinker "
           f"tokens {first['thinker_token_ids']} twice, {first['audio_samples']} audio samples each, the same for "
           f"the first {same}")


def complete_like_oracle(fleet, want: dict, i: int, voice: str | None = None
                         ) -> tuple[dict, list[int], float, float, float]:
    """The oracle's request `want` as a completion of its prompt tokens with `modalities: ["text", "audio"]`
    (and `audio.voice`): asserts the thinker's tokens and the audio (float32 chunks as they left code2wav,
    joined in order) within 1% of the oracle's peak (separate processes of the same build, as for
    Qwen2.5-Omni). Returns the choice, the chunks' sample counts, the time taken, the peak and the largest
    difference."""
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/completions", {
        "model": "qwen3-omni", "prompt": want["prompt_token_ids"], "return_token_ids": True,
        "modalities": ["text", "audio"], **({"audio": {"voice": voice}} if voice else {})}, timeout=600)
    took = time.monotonic() - t
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == want["thinker_token_ids"], (i, choice["token_ids"], want)
    chunks = [o["data"]["audio"] for o in choice.get("omni", []) if o["type"] == "audio"]
    assert chunks and all(c["dtype"] == "float32" for c in chunks), chunks
    raw = [base64.b64decode(c["data"]) for c in chunks]
    got = array("f", b"".join(raw))
    assert len(got) == len(want["audio"]) == want["audio_samples"], (i, len(got), len(want["audio"]))
    peak = max(abs(x) for x in want["audio"])
    worst = max(abs(a - b) for a, b in zip(got, want["audio"]))
    assert worst <= 1e-2 * peak, f"request {i}: audio differs from the oracle's by up to {worst} (peak {peak})"
    return choice, [len(r) // 4 for r in raw], took, peak, worst


def test_qwen3_omni_through_omnifleet_matches_vllm_omnis_own_engine(fleet, oracle, request):
    """The oracle's two requests, in its order, as completions of its prompt tokens (the chat template's) with
    `modalities: ["text", "audio"]`: the audio chunk comes back as it left code2wav (float32 samples)."""
    for i, want in enumerate(oracle[:2]):
        choice, sizes, took, peak, worst = complete_like_oracle(fleet, want, i)
        assert len(sizes) == 1, sizes  # whole-output mode: code2wav vocodes all codes at once
        report(request.config, "vllm-omni-qwen3", f"request {i} through omnifleet (3 stage pods): {took:.2f}s; "
               f"thinker tokens {choice['token_ids']}, {sizes[0]} float32 samples (peak {peak:.3g}; largest "
               f"difference from vLLM-Omni's own engine: {worst:.3g})")


def test_qwen3_omni_image_and_audio_in_text_and_audio_out_match_vllm_omnis_own_engine(fleet, oracle, request):
    """Hear and see, then speak: the oracle's third request, a chat message with a PNG, a WAV and a question,
    decoded by the master and handed to the thinker's engine as multimodal data. Its thinker tokens, prompt
    length (media expanded) and audio length are vLLM-Omni's own engine's."""
    want = oracle[2]
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "qwen3-omni", "messages": media()[0], "return_token_ids": True,
        "modalities": ["text", "audio"], "audio": {"format": "pcm16"}}, timeout=600)
    took = time.monotonic() - t
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == want["thinker_token_ids"], (choice["token_ids"], want)
    assert body["usage"]["prompt_tokens"] == len(want["thinker_prompt_token_ids"]), body["usage"]
    assert len(want["thinker_prompt_token_ids"]) > len(want["prompt_token_ids"]) + 10, "the media were not expanded"
    # 16-bit audio, and this tiny model's is far below one 16-bit step: its length, which the talker's codes decide.
    got = array("h", base64.b64decode(choice["message"]["audio"]["data"]))
    assert want["audio_samples"] > 0 and len(got) == want["audio_samples"], (len(got), want["audio_samples"])
    report(request.config, "vllm-omni-qwen3", f"image + audio + text in, text and audio out through omnifleet: "
           f"{took:.2f}s; prompt {body['usage']['prompt_tokens']} tokens, thinker tokens {choice['token_ids']}, "
           f"{len(got)} samples of audio, as vLLM-Omni's own engine's")


def check_voice(fleet, oracle, request, tag: str) -> tuple[dict, list[int], float, float, float]:
    """The oracle's fourth request, the text one in VOICE, after the third (the engines' generators stay in
    step): the fleet's thinker tokens and audio are the oracle's. A voice the model does not have is a 400
    naming the model's voices, before any engine runs it."""
    status, body = fleet.http("POST", "/v1/completions", {
        "model": "qwen3-omni", "prompt": oracle[3]["prompt_token_ids"], "modalities": ["text", "audio"],
        "audio": {"voice": "Nobody"}}, timeout=120)
    assert status == 400 and "unknown voice 'Nobody' (this model speaks as aiden, chelsie, ethan)" in \
        body["error"]["message"], body
    got = complete_like_oracle(fleet, oracle[3], 3, VOICE)
    report(request.config, tag, f"request 3 through omnifleet in voice {VOICE!r}: {got[2]:.2f}s; {sum(got[1])} "
           f"float32 samples (largest difference from vLLM-Omni's own engine, told the same voice: {got[4]:.3g})")
    return got


def test_qwen3_omni_speaks_in_the_requested_voice_as_vllm_omnis_own_engine(fleet, oracle, request):
    check_voice(fleet, oracle, request, "vllm-omni-qwen3")
