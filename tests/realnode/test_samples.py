"""Shipped samples whose stages can run here, applied as a user would, on the real node."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from array import array
from pathlib import Path

import yaml

from omnifleet_operator.devcluster import commands as dev
from omnifleet_runtime import constants as C
from omnifleet_runtime.devsetup.tiny_model import readable_by_all

from ..engines.conftest import engine_env, tiny_omni_path
from ..engines.qwen_omni_twin import PROMPT, SAMPLE, oracle, twin
from .conftest import PSA_RESTRICTED, REPO, describe_failure, make_namespace, model_claim, wait_ready

PYTHON_CODE = REPO / "manifests" / "samples" / "python-code"
# The stages' pods beside the node's own processes on 2 cores: a request's bound, not a timing goal.
SPEECH_REQUEST_TIMEOUT_S = 300


def test_python_stages_with_their_code_from_a_configmap(cluster, kube):
    """`kubectl apply -k manifests/samples/python-code/`: the code is a ConfigMap volume on PYTHONPATH."""
    ns = make_namespace(cluster, "python-code", PSA_RESTRICTED)
    cluster.kubectl("apply", "-n", ns, "-k", str(PYTHON_CODE))
    wait_ready(kube, cluster, ns, "python-code", timeout=240)
    forward = dev.PortForward(cluster, ns, "svc/python-code-master", C.MASTER_API_PORT)
    try:
        body = json.dumps({"model": "python-code",
                           "messages": [{"role": "user", "content": "hello brave  new world"}]}).encode()
        req = urllib.request.Request(f"{forward.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        assert answer == "HELLO BRAVE NEW WORLD"
    finally:
        forward.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def speech_on_pods(model: str) -> dict:
    """The speech sample's tiny twin as pods run it: the model from the sample's own claim (a hostPath of the
    tiny checkpoint), one replica each and small CPU requests and memory limits in place of the GPU sizes (one
    2-core node), no downloads."""
    d = twin("/models", {"timeoutSeconds": 10})
    d["spec"]["modelVolume"] = yaml.safe_load(SAMPLE.read_text())["spec"]["modelVolume"]
    offline = {"name": "HF_HUB_OFFLINE", "value": "1"}
    for s in d["spec"]["stages"]:
        s["env"] = [offline]
        s["resources"] = {"requests": {"cpu": "100m", "memory": "1Gi"}, "limits": {"memory": "6Gi"}}
        s.pop("replicas", None)
    d["spec"]["stages"][0]["env"].append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"})
    d["spec"]["stages"][0]["shmSize"] = "2Gi"
    return d


def test_the_speech_sample_speaks_on_real_pods_as_transformers_does(cluster, kube, tmp_path: Path):
    """manifests/samples/speech.yaml (stock vLLM's thinker with the hidden-states tap; transformers' talker, and
    code2wav in the talker's pod), its tiny twin applied on the real node from the repo's runtime image: the
    answer's text tokens and audio are transformers' one-process generate's for the same checkpoint."""
    tiny = tiny_omni_path()
    readable_by_all(Path(tiny))  # the pods read it as uid 1000
    want = oracle(tiny, tmp_path, engine_env())
    doc = speech_on_pods(tiny)
    ns = make_namespace(cluster, "speech", PSA_RESTRICTED)
    model_claim(cluster, ns, Path(tiny), claim=doc["spec"]["modelVolume"]["claimName"])
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    forward = None
    try:
        t = time.monotonic()
        wait_ready(kube, cluster, ns, "speech")
        print(f"speech twin ready on real pods in {time.monotonic() - t:.0f}s", flush=True)
        forward = dev.PortForward(cluster, ns, "svc/speech-master", C.MASTER_API_PORT)
        body = json.dumps({"model": "speech", "prompt": PROMPT, "return_token_ids": True,
                           "modalities": ["text", "audio"]}).encode()
        req = urllib.request.Request(f"{forward.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=SPEECH_REQUEST_TIMEOUT_S) as r:
                choice = json.loads(r.read())["choices"][0]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"HTTP {e.code}: {e.read()[:2000]!r}\n{describe_failure(cluster, ns)}") from None
        assert choice["token_ids"] == want["token_ids"], (choice["token_ids"], want["token_ids"])
        [chunk] = [o["data"] for o in choice.get("omni", []) if o["type"] == "audio"]
        got = array("f", base64.b64decode(chunk["audio"]["data"]))
        assert len(want["audio"]) == want["audio_samples"] > 0 and max(abs(x) for x in want["audio"]) > 0
        assert len(got) == len(want["audio"]), (len(got), len(want["audio"]))
        worst = max(abs(a - b) for a, b in zip(got, want["audio"]))
        assert got == want["audio"], f"the pods' audio differs from transformers' by up to {worst}"
        print(f"speech twin on real pods: tokens {choice['token_ids']}, {len(got)} samples equal to transformers'",
              flush=True)
    finally:
        if forward is not None:
            forward.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
