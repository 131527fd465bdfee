"""vLLM-Omni's own stage engines as omnifleet stages: a tiny Qwen2.5-Omni, thinker -> talker -> code2wav.

Each stage is a `vllm-omni` stage in a pod process of its own, run with
vLLM-Omni's environment (built by devsetup.vllm_omni_env; the suite fails if it
cannot be built), behind omnifleet's master. The oracle is vLLM-Omni's own
single-process `Omni` engine running the whole pipeline on the same checkpoint,
prompt, deploy settings and seeds (tests/engines/vllm_omni_oracle.py). Through
omnifleet the first request must give the oracle's thinker tokens and its audio
(float32 samples, equal within float tolerance and as 16-bit PCM). The thinker
stage alone (vllm_omni_stage_probe.py) must put its hidden states on the wire,
equal to those the oracle's thinker output carries: they are what the talker is
made of.

Start-up dominates (minutes per engine on two cores: each engine imports vLLM in three
processes one after another), so the oracle, the fleet and the thinker probe start at once and
share the cores, and one fleet and one oracle serve the module. vLLM-Omni serializes engine starts
per device through a lock file in /tmp; in Kubernetes each pod has its own /tmp, so here each pod
and the probe get a lock file of their own too (`own_device_lock`), and the oracle keeps the host's.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from array import array
from pathlib import Path

import pytest
import yaml

from fleet_harness import Fleet, pipeline  # noqa: E402

from omnifleet_runtime.devsetup import vllm_omni_env  # noqa: E402

from ..conftest import time_limit  # noqa: E402
from .conftest import HEARTBEAT, HERE, end, media, report, run_in_group  # noqa: E402

pytestmark = [pytest.mark.vllm]
# The first test waits for the oracle and the probe, which start beside the fleet on two cores.
TEST_TIMEOUT_S = 2400
START_TIMEOUT_S = 1800  # the oracle's and the probe's whole run, engine starts included, beside the rest
DEVICE_LOCK = "/tmp/vllm_omni_device_0_init.lock"  # vLLM-Omni's engine start lock of device 0 (all stages here)

PROC = "vllm_omni.model_executor.stage_input_processors.qwen2_5_omni"
ENGINE = {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 2048, "max_num_seqs": 1,
          "enforce_eager": True, "trust_remote_code": True, "enable_prefix_caching": False}
# The deploy file's stages as the CPU needs them (code2wav fails in bfloat16), and the sampling
# params of vLLM-Omni's qwen2_5_omni deploy file (the talker's repetition penalty included).
STAGES = [
    dict(name="thinker", stageId=0, modelStage="thinker", workerType="ar", final="text", processor=None,
         engine={**ENGINE, "mm_processor_cache_gb": 0},
         sampling={"max_tokens": 6, "temperature": 0.0, "seed": 42, "repetition_penalty": 1.1}),
    dict(name="talker", stageId=1, modelStage="talker", workerType="ar", final=None,
         processor=f"{PROC}.thinker2talker_token_only", engine=ENGINE,
         sampling={"max_tokens": 16, "temperature": 0.9, "top_p": 0.8, "top_k": 40, "seed": 42,
                   "repetition_penalty": 1.05, "stop_token_ids": [8294]}),
    dict(name="code2wav", stageId=2, modelStage="code2wav", workerType="generation", final="audio",
         processor=f"{PROC}.talker2code2wav_token_only", engine={**ENGINE, "async_scheduling": False},
         sampling={"max_tokens": 2048, "temperature": 0.0, "seed": 42, "repetition_penalty": 1.1}),
]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="module")
def omni_python() -> str:
    try:
        return str(vllm_omni_env.build())
    except Exception as e:  # the suite's real part cannot run: fail, never skip
        pytest.fail(f"vLLM-Omni's environment cannot be built: {e}", pytrace=False)


@pytest.fixture(scope="module")
def tiny_omni(omni_python) -> str:
    proc = subprocess.run([omni_python, "-m", "omnifleet_runtime.devsetup.tiny_omni", "--print-path"],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": f"{root / 'runtime'}:{root}", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1"}


def own_device_lock(omni_python: str, where: Path) -> str:
    """An interpreter that runs vLLM-Omni's python with a device lock file of its own, as a pod's own /tmp
    gives it in Kubernetes: a mount namespace binds a file of `where` over the lock's path."""
    Path(DEVICE_LOCK).touch()  # the bind's target
    where.mkdir(parents=True, exist_ok=True)
    lock, script = where / "device.lock", where / "python"
    lock.touch()
    script.write_text("#!/bin/sh\n"
                      f"exec unshare --mount --propagation private sh -c 'mount --bind \"$0\" {DEVICE_LOCK} && "
                      f"exec \"$@\"' {lock} {omni_python} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture(scope="module")
def oracle_run(omni_python, tiny_omni, tmp_path_factory):
    """vLLM-Omni's own engine on the requests, started (not waited for): the oracle fixture waits."""
    tmp = tmp_path_factory.mktemp("oracle")
    deploy = {"async_chunk": False,
              "stages": [{"stage_id": s["stageId"], "devices": "0", **s["engine"],
                          "default_sampling_params": s["sampling"]}
                         for s in STAGES]}
    (tmp / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    # In the fleet's order: its first request is the text one, its second the one with media.
    (tmp / "request.json").write_text(json.dumps({"prompts": [MESSAGES, media()[1]],
                                                  "sampling_params": [s["sampling"] for s in STAGES]}))
    proc = run_in_group([omni_python, str(HERE / "vllm_omni_oracle.py"), tiny_omni, str(tmp / "deploy.yaml"),
                         str(tmp / "request.json"), str(tmp)], tmp, tmp / "oracle.log", _env())
    yield proc, tmp, time.monotonic()
    end(proc, None)


@pytest.fixture(scope="module")
def oracle(launched, request) -> dict:
    (proc, tmp, t), _ = launched
    end(proc, START_TIMEOUT_S)  # the oracle ends with os._exit; the group's engine processes go with it
    log = (tmp / "oracle.log").read_text(errors="replace")
    assert proc.returncode == 0 and (tmp / "result.json").exists(), log[-6000:]
    result = json.loads((tmp / "result.json").read_text())
    for i, one in enumerate(result["requests"]):
        one["audio"] = array("f", (tmp / f"audio.{i}.f32").read_bytes())
        one["thinker_hidden"] = array("f", (tmp / f"thinker_hidden.{i}.f32").read_bytes())
    report(request.config, "vllm-omni", f"oracle (vLLM-Omni's Omni, 3 stages in one process, beside the fleet): "
           f"engine start {result['start_s']:.1f}s, total {time.monotonic() - t:.1f}s")
    return result["requests"]


def omni_pipeline(name: str, model: str, key: str, stages: list[dict]) -> dict:
    """An OmniPipeline of `vllm-omni` stages in a chain, stages of vLLM-Omni's pipeline `key`: each of `stages`
    names its name, stageId, modelStage, workerType, engine args, sampling, final output and input processor
    (and, in async-chunk mode, `async` and its `stage_config`)."""
    docs: list[dict] = []
    for s in stages:
        stage = {"name": s["name"], "type": "vllm-omni", "gpus": 0, "engineArgs": s["engine"],
                 "samplingParams": s["sampling"], "engineStartTimeoutSeconds": 1500,
                 "vllmOmni": {"pipeline": key, "stageId": s["stageId"], "modelStage": s["modelStage"],
                              "workerType": s["workerType"]}}
        if s.get("processor"):
            stage["vllmOmni"]["inputProcessor"] = s["processor"]
        if s.get("final"):
            stage["finalOutput"] = s["final"]
        if s.get("async"):  # vLLM-Omni's async-chunk mode, its stage config (connector settings) as imported
            stage["vllmOmni"].update(asyncChunk=True, stageConfig=s.get("stage_config") or {})
        if docs:
            stage["inputs"] = [docs[-1]["name"]]
            stage["inputMode"] = "stream" if s.get("async") else "whole"
        docs.append(stage)
    d = pipeline(*docs, name=name)
    d["spec"]["model"] = model
    d["spec"]["heartbeat"] = HEARTBEAT
    return d


def doc(model: str) -> dict:
    return omni_pipeline("qwen-omni", model, "qwen2_5_omni", STAGES)


def start_fleet(tmp: Path, d: dict, omni_python: str, one_session: bool = False):
    """A module fixture's body: the master and a pod per stage, started (not waited for; `ready` waits), each
    pod with vLLM-Omni's python and a device lock of its own; one_session: all in the test's session."""
    f = Fleet(tmp, d)
    f.own_sessions = not one_session
    f.env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    t = time.monotonic()
    try:
        f.start_master()
        for s in d["spec"]["stages"]:
            f.start_pod(f"{s['name']}-0", s["name"], python=own_device_lock(omni_python, tmp / s["name"]))
        yield f, t
    finally:
        f.stop()


def ready(launched, request, tag: str) -> Fleet:
    _, (f, t) = launched
    try:
        f.wait_ready(timeout=2000)
    except BaseException:
        print(f.logs()[-30000:])
        raise
    report(request.config, tag, f"fleet of {len(f.pod_stages)} vLLM-Omni stage engines (one pod each) ready "
           f"within {time.monotonic() - t:.1f}s of its start (checked once the oracle was done; started beside "
           f"it on {len(os.sched_getaffinity(0))} cores)")
    return f


@pytest.fixture(scope="module")
def fleet_run(omni_python, tiny_omni, tmp_path_factory):
    """The fleet's master and stage pods, started (not waited for): the fleet fixture waits."""
    yield from start_fleet(tmp_path_factory.mktemp("omni-fleet"), doc(tiny_omni), omni_python)


@pytest.fixture(scope="module")
def fleet(launched, request):
    return ready(launched, request, "vllm-omni")


def chat(fleet: Fleet) -> dict:
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "qwen-omni", "messages": MESSAGES, "return_token_ids": True,
        "modalities": ["text", "audio"], "audio": {"format": "pcm16"}})
    assert status == 200, body
    return body


def pcm16(samples) -> array:
    """The oracle's float samples as the master encodes audio (media.audio_of): clipped, scaled, truncated."""
    return array("h", (int(max(-1.0, min(1.0, x)) * 32767.0) for x in samples))


def test_thinker_stage_puts_its_hidden_states_on_the_wire(omni_python, tiny_omni, launched, tmp_path, request):
    """What the talker is made of: the thinker stage's output carries its hidden states as a wire array, for a
    text prompt and for one with an image and audio (which the stage hands its engine as multimodal data)."""
    (tmp_path / "pipeline.json").write_text(json.dumps(doc(tiny_omni)))
    (tmp_path / "request.json").write_text(json.dumps({"prompts": [MESSAGES, media()[1]]}))
    t = time.monotonic()
    proc = run_in_group([own_device_lock(omni_python, tmp_path), str(HERE / "vllm_omni_stage_probe.py"),
                         str(tmp_path / "pipeline.json"), "thinker", str(tmp_path / "request.json"), str(tmp_path)],
                        tmp_path, tmp_path / "probe.log", _env())
    try:
        oracle = request.getfixturevalue("oracle")  # it runs meanwhile
    finally:
        end(proc, START_TIMEOUT_S)
    log = (tmp_path / "probe.log").read_text(errors="replace")
    assert proc.returncode == 0 and (tmp_path / "chunk.1.json").exists(), log[-6000:]
    for i, want in enumerate(oracle):
        chunk = json.loads((tmp_path / f"chunk.{i}.json").read_text())
        assert chunk["token_ids"] == want["thinker_token_ids"]
        # The prompt as the engine ran it: with media, each placeholder expanded to the media's length.
        assert chunk["prompt_token_ids"] == want["thinker_prompt_token_ids"]
        hidden = chunk["extra"].get("hidden")
        assert hidden is not None, f"no hidden states on the wire (extra: {chunk['extra']})"
        rows = len(chunk["prompt_token_ids"]) + len(chunk["token_ids"]) - 1  # the last token is never forwarded
        assert hidden["dtype"] == "float32" and hidden["shape"] == [rows, 128], hidden
        assert hidden["shape"] == want["thinker_hidden_shape"]
        got = array("f", (tmp_path / f"extra.{i}.hidden.bin").read_bytes())
        worst = max(abs(a - b) for a, b in zip(got, want["thinker_hidden"]))
        assert len(got) == len(want["thinker_hidden"]) and worst <= 1e-4, \
            f"request {i}: hidden states differ from the oracle's by up to {worst}"
        report(request.config, "vllm-omni", f"thinker stage alone, {'text' if i == 0 else 'image + audio + text'}: "
               f"hidden states {hidden['shape']} on the wire (largest difference from vLLM-Omni's own engine: "
               f"{worst:.2e})")
    media_prompt, text_prompt = oracle[1]["thinker_prompt_token_ids"], oracle[0]["thinker_prompt_token_ids"]
    assert len(media_prompt) > len(oracle[1]["prompt_token_ids"]) + 10, "the media were not expanded into the prompt"
    report(request.config, "vllm-omni", f"thinker stage alone: {time.monotonic() - t:.1f}s; the image and audio "
           f"took {len(media_prompt) - len(oracle[1]['prompt_token_ids'])} prompt tokens beyond their placeholders "
           f"(text prompt: {len(text_prompt)} tokens)")


def test_thinker_and_audio_through_omnifleet_match_vllm_omnis_own_engine(fleet, oracle, request):
    """The fleet's first request (code2wav draws its noise from the engine's global generator, so only a fresh
    engine's first request is comparable with the oracle's): a completion of the oracle's prompt tokens with
    `modalities: ["text", "audio"]`, whose audio chunk comes back as it left code2wav (float32 samples, in the
    choice's `omni` field)."""
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/completions", {
        "model": "qwen-omni", "prompt": oracle[0]["prompt_token_ids"], "return_token_ids": True,
        "modalities": ["text", "audio"]})
    took = time.monotonic() - t
    assert status == 200, body
    choice = body["choices"][0]
    assert oracle[0]["thinker_token_ids"], oracle[0]
    assert choice["token_ids"] == oracle[0]["thinker_token_ids"]
    [chunk] = [o["data"] for o in choice.get("omni", []) if o["type"] == "audio"]
    assert chunk["audio"]["dtype"] == "float32", chunk["audio"]
    got = array("f", base64.b64decode(chunk["audio"]["data"]))
    want = oracle[0]["audio"]
    assert oracle[0]["audio_samples"] > 0 and len(got) == len(want) == oracle[0]["audio_samples"], (len(got), len(want))
    peak = max(abs(x) for x in want)
    assert peak > 0, "the oracle's audio is all zeros"
    worst = max(abs(a - b) for a, b in zip(got, want))
    # float32 samples computed by separate processes of the same build and thread count. Measured: up to
    # 0.15% of the peak apart (not bit-equal; where they diverge, talker codes or code2wav's arithmetic,
    # is not found yet): the bound is 1% of the peak, far below any audible or 16-bit PCM difference.
    assert worst <= 1e-2 * peak, f"audio differs from the oracle's by up to {worst} (its peak: {peak})"
    assert pcm16(got) == pcm16(want)
    report(request.config, "vllm-omni", f"request through omnifleet (3 stage pods): {took:.2f}s; thinker tokens "
           f"{choice['token_ids']} and {len(got)} float32 samples of audio (peak {peak:.3g}; largest difference "
           f"from vLLM-Omni's own engine: {worst:.3g})")


def test_image_and_audio_in_text_and_audio_out_match_vllm_omnis_own_engine(fleet, oracle, request):
    """Hear and see, then speak: the fleet's second request, a chat message with a PNG, a WAV and a question,
    decoded by the master and handed to the thinker's engine as multimodal data. Its thinker tokens, prompt
    length and audio length match vLLM-Omni's own engine's."""
    want = oracle[1]
    t = time.monotonic()
    status, body = fleet.http("POST", "/v1/chat/completions", {
        "model": "qwen-omni", "messages": media()[0], "return_token_ids": True,
        "modalities": ["text", "audio"], "audio": {"format": "pcm16"}})
    took = time.monotonic() - t
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == want["thinker_token_ids"]
    # The thinker's prompt as its engine ran it, media expanded: what `usage` reports for the entry stage.
    assert body["usage"]["prompt_tokens"] == len(want["thinker_prompt_token_ids"]), body["usage"]
    # A chat answer carries 16-bit audio, and this tiny model's is far below one 16-bit step (the first
    # request's test compares float samples): here its length, which the talker's codes decide.
    got = array("h", base64.b64decode(choice["message"]["audio"]["data"]))
    assert want["audio_samples"] > 0 and len(got) == want["audio_samples"], (len(got), want["audio_samples"])
    report(request.config, "vllm-omni", f"image + audio + text in, text and audio out through omnifleet: "
           f"{took:.2f}s; prompt {body['usage']['prompt_tokens']} tokens, thinker tokens {choice['token_ids']} and "
           f"{len(got)} samples of audio, as vLLM-Omni's own engine's")


def test_same_request_twice_gives_the_same_tokens(fleet):
    """Seeded sampling: a repeated chat request gets the same thinker tokens and the same length of audio.

    (The samples themselves differ: code2wav draws its noise from the engine's global generator, as in
    vLLM-Omni's own engine.)"""
    a, b = chat(fleet), chat(fleet)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert len(a["choices"][0]["message"]["audio"]["data"]) == len(b["choices"][0]["message"]["audio"]["data"])
