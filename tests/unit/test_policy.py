"""What the operator refuses unless a platform team allows it, and secrets written as literals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnifleet_operator.checks import PERMISSIVE, Policy, check_document

REPO = Path(__file__).resolve().parents[2]


def doc(**spec) -> dict:
    stages = spec.pop("stages", None) or [{"name": "llm", "type": "llm", "finalOutput": "text"}]
    return {"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "p"},
            "spec": {"model": "/models/m", "stages": stages, **spec}}


def problems(d, policy=Policy()) -> dict[str, str]:
    return {p.path: p.message for p in check_document(d, policy)[1]}


def test_host_path_and_external_services_are_refused_by_default_and_allowed_by_flags():
    d = doc(modelVolume={"hostPath": "/srv/models"}, master={"serviceType": "LoadBalancer"})
    found = problems(d)
    assert found["spec.modelVolume.hostPath"].startswith("hostPath volumes are refused by this operator")
    assert "--allow-host-path" in found["spec.modelVolume.hostPath"]
    assert found["spec.master.serviceType"].startswith("LoadBalancer is refused by this operator")
    assert problems(doc(master={"serviceType": "NodePort"}))["spec.master.serviceType"].startswith("NodePort")
    assert problems(d, Policy(allow_host_path=True)).keys() == {"spec.master.serviceType"}
    assert problems(d, Policy(allow_external_service=True)).keys() == {"spec.modelVolume.hostPath"}
    assert problems(d, PERMISSIVE) == {}
    assert problems(doc(modelVolume={"claimName": "w"})) == {}


@pytest.mark.parametrize("env, path", [
    ({"name": "HF_TOKEN", "value": "anything"}, "spec.stages[0].env[0].value"),
    ({"name": "OPENAI_API_KEY", "value": "x"}, "spec.stages[0].env[0].value"),
    ({"name": "DB_PASSWORD", "value": "hunter2"}, "spec.stages[0].env[0].value"),
    ({"name": "ANY", "value": "hf_" + "a" * 34}, "spec.stages[0].env[0].value"),
    ({"name": "ANY", "value": "AKIA" + "A" * 16}, "spec.stages[0].env[0].value"),
])
def test_literal_secrets_in_env_are_refused_with_a_pointer(env, path):
    d = doc(stages=[{"name": "llm", "type": "llm", "finalOutput": "text", "env": [env]}])
    msg = problems(d)[path]
    assert "looks like a secret" in msg and "valueFrom.secretKeyRef" in msg


def test_secrets_from_secret_refs_and_plain_values_pass():
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    d = doc(stages=[{"name": "llm", "type": "llm", "finalOutput": "text", "env": env}],
            master={"env": [{"name": "MODE", "value": "fast"}]})
    assert problems(d) == {}  # TOKEN inside a longer word (TOKENIZERS) is no secret's name


def test_engine_arg_tokens_are_refused():
    d = doc(stages=[{"name": "llm", "type": "llm", "finalOutput": "text",
                     "engineArgs": {"hf_token": "hf_" + "b" * 34, "max_model_len": 128, "revision": "main",
                                    "tokenizer": "/models/tok"}}])
    found = problems(d)
    assert list(found) == ["spec.stages[0].engineArgs.hf_token"]
    assert "valueFrom.secretKeyRef" in found["spec.stages[0].engineArgs.hf_token"]


def test_validate_command_has_the_operators_flags(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(doc(modelVolume={"hostPath": "/srv/models"})))
    cmd = [sys.executable, "-m", "omnifleet_operator.cli", "validate", "-f", str(f)]
    refused = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert refused.returncode == 1 and "spec.modelVolume.hostPath: hostPath volumes are refused" in refused.stderr
    allowed = subprocess.run(cmd + ["--allow-host-path"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert allowed.returncode == 0, allowed.stderr


def _egress(stages):
    from omnifleet_operator.render import desired

    parsed, found = check_document(doc(stages=stages))
    assert parsed is not None, found
    return [o for o in desired(parsed) if o["metadata"]["name"] == "p-egress"]


def test_stage_egress_is_the_pipeline_and_dns_unless_a_stage_opts_out():
    a = {"name": "a", "type": "python", "entrypoint": "m:f"}
    b = {"name": "b", "type": "python", "entrypoint": "m:f", "inputs": ["a"], "finalOutput": "text"}
    c = {"name": "c", "type": "python", "entrypoint": "m:f", "inputs": ["b"], "colocateWith": "b"}
    (policy,) = _egress([a, b])
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Egress"]
    assert spec["podSelector"] == {"matchLabels": {"omnifleet.dev/pipeline": "p", "omnifleet.dev/component": "stage"}}
    assert spec["egress"][0] == {"to": [{"podSelector": {"matchLabels": {"omnifleet.dev/pipeline": "p"}}}]}
    assert [r["ports"][0]["port"] for r in spec["egress"][1:]] == [53, 53]
    # A co-located stage that opts out opens its host's pods; the other pods stay closed.
    (policy,) = _egress([a, b, {**c, "egress": "any"}])
    assert policy["spec"]["podSelector"]["matchExpressions"] == [
        {"key": "omnifleet.dev/stage", "operator": "NotIn", "values": ["b"]}]
    assert _egress([{**a, "egress": "any"}, {**b, "egress": "any"}]) == []


def test_another_pipelines_keys_secret_cannot_be_mounted_or_read_into_env():
    # The operator mounts what a spec names: naming `other-keys` would hand this pipeline's pods other's ZMQ keys.
    stage = {"name": "llm", "type": "llm", "finalOutput": "text",
             "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "other-keys", "key": "master.key"}}},
                     {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
             "volumes": [{"name": "a", "secret": {"secretName": "other-keys"}},
                         {"name": "b", "projected": {"sources": [{"configMap": {"name": "c"}},
                                                                 {"secret": {"name": "x-keys"}}]}},
                         {"name": "c", "secret": {"secretName": "tls"}}]}
    found = problems(doc(stages=[stage], master={"volumes": [{"name": "k", "secret": {"secretName": "p-keys"}}]}))
    assert set(found) == {"spec.stages[0].env[0].valueFrom.secretKeyRef.name", "spec.stages[0].volumes[0].secret.secretName",
                          "spec.stages[0].volumes[1].projected.sources[1].secret.name",
                          "spec.master.volumes[0].secret.secretName"}, found
    assert "reserved for pipelines' ZMQ keys" in found["spec.stages[0].volumes[0].secret.secretName"]
