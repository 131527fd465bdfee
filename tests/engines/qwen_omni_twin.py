"""The speech sample's tiny CPU twin and its oracle, shared by the local-process test
(tests/engines/test_qwen_omni_stock.py) and the real-pods test (tests/realnode/test_samples.py).

The twin is manifests/samples/speech.yaml with the tiny seeded Qwen2.5-Omni (devsetup.tiny_omni) and what
a CPU and an exact comparison need: float32, a small context, a greedy talker, code2wav seeded as the
oracle's generator. The oracle is transformers' one-process generate (qwen_omni_hf_oracle.py) on the same
checkpoint and prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import yaml

from omnifleet_runtime.engines.hidden import TAP

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parents[1] / "manifests" / "samples" / "speech.yaml"
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # user: "h", then the assistant's turn
THINKER_TOKENS, TALKER_TOKENS, SEED, SPEAKER = 6, 16, 1234, "Chelsie"
REPETITION_PENALTY = yaml.safe_load(SAMPLE.read_text())["spec"]["stages"][0]["samplingParams"]["repetition_penalty"]


def twin(model: str, heartbeat: dict[str, float]) -> dict[str, Any]:
    """The sample with the tiny model at `model` (no modelVolume, no resources, no GPUs)."""
    d = yaml.safe_load(SAMPLE.read_text())
    d["spec"]["model"] = model
    d["spec"].pop("modelVolume")
    d["spec"]["heartbeat"] = heartbeat
    thinker, talker, code2wav = d["spec"]["stages"]
    assert thinker["engineArgs"]["worker_extension_cls"] == TAP, thinker
    for s in (thinker, talker):
        s["gpus"] = 0
        s.pop("resources")
    code2wav.pop("resources")
    thinker["engineArgs"].update(dtype="float32", max_model_len=512, max_num_seqs=1, seed=0,
                                 limit_mm_per_prompt={"image": 1, "audio": 1, "video": 0})
    thinker["engineArgs"].pop("gpu_memory_utilization")
    thinker["samplingParams"]["max_tokens"] = THINKER_TOKENS
    talker["engineArgs"] = {"device": "cpu", "max_concurrency": talker["engineArgs"]["max_concurrency"],
                            "factory_kwargs": {**talker["engineArgs"]["factory_kwargs"], "dtype": "float32",
                                               "do_sample": False, "max_new_tokens": TALKER_TOKENS}}
    code2wav["engineArgs"] = {"device": "cpu", "factory_kwargs": {**code2wav["engineArgs"]["factory_kwargs"],
                                                                  "seed": SEED}}
    return d


def oracle(model: str, tmp: Path, env: dict[str, str], messages: list | None = None) -> dict[str, Any]:
    """transformers' one-process answer to PROMPT, or to chat `messages` with media parts as the master decodes
    them: {prompt_token_ids, token_ids, codes, audio (array 'f'), audio_samples, and for PROMPT hidden (array
    'f') and hidden_shape}."""
    prompt = {"messages": messages} if messages else {"prompt_token_ids": PROMPT}
    (tmp / "request.json").write_text(json.dumps({
        **prompt, "thinker_max_new_tokens": THINKER_TOKENS,
        "talker_max_new_tokens": TALKER_TOKENS, "speaker": SPEAKER, "seed": SEED,
        "thinker_repetition_penalty": REPETITION_PENALTY}))
    proc = subprocess.run([sys.executable, str(HERE / "qwen_omni_hf_oracle.py"), model, str(tmp / "request.json"),
                           str(tmp)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert proc.returncode == 0 and (tmp / "result.json").exists(), proc.stderr[-6000:]
    result = json.loads((tmp / "result.json").read_text())
    result["audio"] = array("f", (tmp / "audio.f32").read_bytes())
    if not messages:
        result["hidden"] = array("f", (tmp / "hidden.f32").read_bytes())
    return result
