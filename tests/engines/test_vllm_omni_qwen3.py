"""vLLM-Omni's own engines on a tiny Qwen3-Omni on the CPU: the MoE thinker, the MoE talker with its code
predictor, code2wav, in vLLM-Omni's whole-output mode (`async_chunk: false`).

vLLM-Omni's single-process `Omni` engine (tests/engines/vllm_omni_oracle.py) runs the three stages on the CPU
through omnifleet's platform plugin (plugins/omnifleet-vllm-omni-cpu), on the tiny checkpoint that
tests/engines/tiny_qwen3_omni.py makes, with vLLM-Omni's Qwen3-Omni deploy settings made CPU-sized (float32
but the talker, eager, no CUDA graphs, the MoE backend vLLM picks). The same request twice must give the same
thinker tokens and audio of the same length. Not the same audio: the talker draws its first codebook with the
request's seed (the deploy file's), but its code predictor draws the other codebooks from the engine's global
generator, so in one process the second request's codes part from the first's (the report says from which
sample its audio differs); a distributed run is to be compared with a run of the same requests in the same
order.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from array import array

import pytest
import yaml

from ..conftest import time_limit  # noqa: E402
from .conftest import HERE, end, report, run_in_group  # noqa: E402
from .test_vllm_omni import _env, omni_python  # noqa: E402,F401 (omni_python: a fixture, vLLM-Omni's python)

pytestmark = [pytest.mark.vllm]
TEST_TIMEOUT_S = 1500
RUN_TIMEOUT_S = 1200  # the engine's start (about 2.5 min alone on two cores) and two requests

ENGINE = {"devices": "0", "dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 2048,
          "max_num_seqs": 1, "enforce_eager": True, "moe_backend": "auto", "max_cudagraph_capture_size": 0,
          "trust_remote_code": True, "enable_prefix_caching": False}
# vLLM-Omni's qwen3_omni_moe deploy file's sampling (its talker's seed included), the lengths made small.
SAMPLING = [
    {"temperature": 0.0, "max_tokens": 6, "seed": 42},
    {"temperature": 0.9, "top_k": 50, "max_tokens": 16, "seed": 42, "repetition_penalty": 1.05},
    {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2048, "repetition_penalty": 1.1},
]
# The talker in bfloat16: vLLM-Omni's Qwen3-Omni talker makes its input rows in bfloat16 whatever the model's
# dtype (float32 fails: "mat1 and mat2 must have the same dtype").
STAGES = [{**ENGINE, "mm_processor_cache_gb": 0}, {**ENGINE, "dtype": "bfloat16"},
          {**ENGINE, "enable_chunked_prefill": False, "async_scheduling": False}]
MESSAGES = [{"role": "user", "content": "hi"}]


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


def test_vllm_omni_runs_a_tiny_qwen3_omni_on_the_cpu(omni_python, tiny_qwen3_omni, tmp_path, request):
    deploy = {"async_chunk": False, "stages": [{"stage_id": i, **engine, "default_sampling_params": SAMPLING[i]}
                                               for i, engine in enumerate(STAGES)]}
    (tmp_path / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    (tmp_path / "request.json").write_text(json.dumps({"prompts": [MESSAGES, MESSAGES], "sampling_params": SAMPLING}))
    t = time.monotonic()
    proc = run_in_group([omni_python, str(HERE / "vllm_omni_oracle.py"), tiny_qwen3_omni,
                         str(tmp_path / "deploy.yaml"), str(tmp_path / "request.json"), str(tmp_path)],
                        tmp_path, tmp_path / "omni.log", _env())
    end(proc, RUN_TIMEOUT_S)  # the oracle ends with os._exit; the group's engine processes go with it
    log = (tmp_path / "omni.log").read_text(errors="replace")
    assert proc.returncode == 0 and (tmp_path / "result.json").exists(), log[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    first, second = result["requests"]
    assert len(first["thinker_token_ids"]) == SAMPLING[0]["max_tokens"], first
    assert first["thinker_hidden_shape"][0] > 0 and first["sample_rate"] == 24000, first
    audio = [array("f", (tmp_path / f"audio.{i}.f32").read_bytes()) for i in (0, 1)]
    assert len(audio[0]) == first["audio_samples"] > 0 and all(map(math.isfinite, audio[0])), first
    assert max(map(abs, audio[0])) > 0, "silence"
    assert second["thinker_token_ids"] == first["thinker_token_ids"], (first, second)
    assert len(audio[1]) == len(audio[0]), (first, second)
    same = next((i for i, (x, y) in enumerate(zip(*audio)) if x != y), len(audio[0]))
    report(request.config, "vllm-omni-qwen3", f"vLLM-Omni's Omni on a tiny Qwen3-Omni (3 stages, CPU): engine "
           f"start {result['start_s']:.1f}s, total {time.monotonic() - t:.1f}s; thinker tokens "
           f"{first['thinker_token_ids']} twice, {first['audio_samples']} audio samples each, the same for the "
           f"first {same}")
