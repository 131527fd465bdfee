"""Malformed pipelines: each error must name the right field path."""

from __future__ import annotations

import copy

import pytest

from omnifleet_operator.checks import check_document


def base() -> dict:
    return {
        "apiVersion": "omnifleet.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "speech"},
        "spec": {
            "model": "/models/m",
            "stages": [
                {"name": "thinker", "type": "llm", "finalOutput": "text"},
                {"name": "talker", "type": "llm", "inputs": ["thinker"],
                 "inputProcessor": "pkg.proc:thinker_to_talker"},
                {"name": "code2wav", "type": "python", "entrypoint": "pkg.vocoder:run", "inputs": ["talker"],
                 "colocateWith": "talker", "finalOutput": "audio"},
            ],
        },
    }


def stage(doc: dict, i: int) -> dict:
    return doc["spec"]["stages"][i]


def _set(path, value):
    def mutate(doc):
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
    return mutate


def _del(path):
    def mutate(doc):
        target = doc
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]
    return mutate


def _many(*fns):
    def mutate(doc):
        for f in fns:
            f(doc)
    return mutate


S = ("spec", "stages")
OMNI = {"pipeline": "qwen2_5_omni", "stageId": 0, "modelStage": "thinker", "workerType": "ar"}

CASES = [
    # (id, mutation, expected path, fragment of the message)
    ("not-a-mapping", lambda d: d.clear(), "kind", "Field required"),
    ("wrong-kind", _set(("kind",), "Pipeline"), "kind", "OmniPipeline"),
    ("wrong-api-version", _set(("apiVersion",), "omnifleet.dev/v1"), "apiVersion", "v1alpha1"),
    ("no-spec", _del(("spec",)), "spec", "Field required"),
    ("no-stages", _set(("spec", "stages"), []), "spec.stages", "at least 1"),
    ("unknown-spec-field", _set(("spec", "replicas"), 3), "spec.replicas", "unknown field"),
    ("admin-source-empty", _set(("spec", "master"), {"adminSources": [{}]}), "spec.master.adminSources[0]",
     "set podSelector, namespaceSelector or ipBlock"),
    ("admin-source-mixed", _set(("spec", "master"), {"adminSources": [{"ipBlock": {"cidr": "2001:db8::/64"},
                                                                       "podSelector": {}}]}),
     "spec.master.adminSources[0].ipBlock", "does not combine"),
    ("admin-source-unknown", _set(("spec", "master"), {"adminSources": [{"namespaceSelectr": {}}]}),
     "spec.master.adminSources[0].namespaceSelectr", "unknown field"),
    ("request-timeout-over-cap", _set(("spec", "master"), {"limits": {"requestTimeoutSeconds": 7200}}),
     "spec.master.limits.requestTimeoutSeconds", "must not exceed maxRequestTimeoutSeconds"),
    ("max-inflight-zero", _set(("spec", "master"), {"limits": {"maxInflight": 0}}), "spec.master.limits.maxInflight",
     "greater than or equal to 1"),
    ("api-key-secret-no-key", _set(("spec", "master"), {"apiKeySecret": {"name": "k"}}), "spec.master.apiKeySecret.key",
     "Field required"),
    ("unknown-stage-field", _set(S + (0, "gpu"), 1), "spec.stages[0].gpu", "unknown field"),
    ("stage-name-uppercase", _set(S + (0, "name"), "Thinker"), "spec.stages[0].name", "pattern"),
    ("stage-name-underscore", _set(S + (0, "name"), "the_thinker"), "spec.stages[0].name", "pattern"),
    ("stage-name-too-long", _set(S + (0, "name"), "a" * 51), "spec.stages[0].name", "at most 50"),
    ("stage-type-unknown", _set(S + (0, "type"), "tts"), "spec.stages[0].type", "'llm'"),
    ("stage-no-type", _del(S + (0, "type")), "spec.stages[0].type", "Field required"),
    ("negative-gpus", _set(S + (1, "gpus"), -1), "spec.stages[1].gpus", "greater than or equal to 0"),
    ("negative-replicas", _set(S + (1, "replicas"), -2), "spec.stages[1].replicas", "greater than or equal to 0"),
    ("bad-final-output", _set(S + (0, "finalOutput"), "speech"), "spec.stages[0].finalOutput", "'text'"),
    ("bad-input-mode", _set(S + (1, "inputMode"), "chunks"), "spec.stages[1].inputMode", "'stream'"),
    ("processor-no-colon", _set(S + (1, "inputProcessor"), "pkg.proc.fn"), "spec.stages[1].inputProcessor", "pattern"),
    ("processor-bad-module", _set(S + (1, "inputProcessor"), "9pkg:fn"), "spec.stages[1].inputProcessor", "pattern"),
    ("entrypoint-two-colons", _set(S + (2, "entrypoint"), "a:b:c"), "spec.stages[2].entrypoint", "pattern"),
    ("python-without-entrypoint", _del(S + (2, "entrypoint")), "spec.stages[2].entrypoint", "required"),
    ("llm-with-entrypoint", _set(S + (0, "entrypoint"), "m:f"), "spec.stages[0].entrypoint", "not used"),
    ("vllm-omni-without-block", _set(S + (0, "type"), "vllm-omni"), "spec.stages[0].vllmOmni", "required"),
    ("vllm-omni-block-on-llm", _set(S + (0, "vllmOmni"), OMNI), "spec.stages[0].vllmOmni", "only for vllm-omni"),
    ("vllm-omni-with-entrypoint", _many(_set(S + (0, "type"), "vllm-omni"), _set(S + (0, "vllmOmni"), OMNI),
                                        _set(S + (0, "entrypoint"), "m:f")), "spec.stages[0].entrypoint", "not used"),
    ("vllm-omni-bad-devices", _many(_set(S + (0, "type"), "vllm-omni"), _set(S + (0, "vllmOmni"), {**OMNI, "devices": "0;1"})),
     "spec.stages[0].vllmOmni.devices", "pattern"),
    ("vllm-omni-colon-processor", _many(_set(S + (0, "type"), "vllm-omni"),
                                        _set(S + (0, "vllmOmni"), {**OMNI, "inputProcessor": "m:f"})),
     "spec.stages[0].vllmOmni.inputProcessor", "pattern"),
    ("vllm-omni-bad-worker", _many(_set(S + (0, "type"), "vllm-omni"), _set(S + (0, "vllmOmni"), {**OMNI, "workerType": "gpu"})),
     "spec.stages[0].vllmOmni.workerType", "'ar'"),
    ("duplicate-stage", _set(S + (1, "name"), "thinker"), "spec.stages[1].name", "duplicate"),
    ("input-unknown", _set(S + (1, "inputs"), ["thinkr"]), "spec.stages[1].inputs[0]", "no stage named 'thinkr'"),
    ("input-self", _set(S + (1, "inputs"), ["talker"]), "spec.stages[1].inputs[0]", "own input"),
    ("input-twice", _set(S + (1, "inputs"), ["thinker", "thinker"]), "spec.stages[1].inputs", "more than once"),
    ("two-entries", _set(S + (1, "inputs"), []), "spec.stages", "exactly one stage must have no inputs"),
    ("no-entry-cycle", _set(S + (0, "inputs"), ["code2wav"]), "spec.stages", "exactly one stage must have no inputs"),
    ("no-final-output", _many(_set(S + (0, "finalOutput"), "none"), _set(S + (2, "finalOutput"), "none")),
     "spec.stages", "at least one stage must have a finalOutput"),
    ("colocate-unknown", _set(S + (2, "colocateWith"), "vocoder"), "spec.stages[2].colocateWith", "no stage named"),
    ("colocate-self", _set(S + (2, "colocateWith"), "code2wav"), "spec.stages[2].colocateWith", "itself"),
    ("colocate-chain", _set(S + (1, "colocateWith"), "thinker"), "spec.stages[2].colocateWith", "itself co-located"),
    ("colocated-with-gpus", _set(S + (2, "gpus"), 1), "spec.stages[2].gpus", "shares its host's gpus"),
    ("colocated-with-replicas", _set(S + (2, "replicas"), 2), "spec.stages[2].replicas", "shares its host's"),
    ("colocated-with-autoscaling", _set(S + (2, "autoscaling"), {"maxReplicas": 3}),
     "spec.stages[2].autoscaling", "shares its host's"),
    ("colocated-other-image", _set(S + (2, "image"), "other:1"), "spec.stages[2].image", "uses its image"),
    ("replicas-and-autoscaling", _many(_set(S + (1, "replicas"), 2), _set(S + (1, "autoscaling"), {"maxReplicas": 3})),
     "spec.stages[1].autoscaling", "not both"),
    ("lora-on-a-python-stage", _set(S + (2, "loras"), [{"name": "a", "path": "/m/a"}]), "spec.stages[2].loras",
     "only llm stages"),
    ("lora-twice", _many(_set(S + (0, "loras"), [{"name": "a", "path": "/m/a"}, {"name": "a", "path": "/m/b"}])),
     "spec.stages[0].loras[1].name", "duplicate adapter name 'a'"),
    ("lora-bad-name", _set(S + (0, "loras"), [{"name": "A_B", "path": "/m/a"}]), "spec.stages[0].loras[0].name",
     "pattern"),
    ("min-over-max", _set(S + (1, "autoscaling"), {"minReplicas": 5, "maxReplicas": 3}),
     "spec.stages[1].autoscaling.minReplicas", "must not exceed maxReplicas"),
    ("autoscaling-no-max", _set(S + (1, "autoscaling"), {"minReplicas": 1}),
     "spec.stages[1].autoscaling.maxReplicas", "Field required"),
    ("autoscaling-negative-min", _set(S + (1, "autoscaling"), {"minReplicas": -1, "maxReplicas": 2}),
     "spec.stages[1].autoscaling.minReplicas", "greater than or equal to 0"),
    ("autoscaling-zero-min-on-audio", _set(S + (1, "autoscaling"), {"minReplicas": 0, "maxReplicas": 2}),
     "spec.stages[1].autoscaling.minReplicas", "scale to zero"),
    ("gpu-share-over-one", _many(_set(S + (1, "engineArgs"), {"gpu_memory_utilization": 0.9}),
                                 _set(S + (2, "engineArgs"), {"gpu_memory_utilization": 0.2})),
     "spec.stages[1].engineArgs.gpu_memory_utilization", "1.10 > 1.0"),
    ("gpu-share-not-number", _set(S + (1, "engineArgs"), {"gpu_memory_utilization": "lots"}),
     "spec.stages[1].engineArgs.gpu_memory_utilization", "must be a number"),
    ("bad-quantity", _set(S + (0, "resources"), {"requests": {"memory": "8 gigs"}}),
     "spec.stages[0].resources.requests.memory", "pattern"),
    ("bad-shm-size", _set(S + (0, "shmSize"), "huge"), "spec.stages[0].shmSize", "pattern"),
    ("bad-env-name", _set(S + (0, "env"), [{"name": "1=x", "value": "v"}]), "spec.stages[0].env[0].name", "pattern"),
    ("bad-toleration-effect", _set(S + (0, "tolerations"), [{"key": "k", "effect": "Never"}]),
     "spec.stages[0].tolerations[0].effect", "'NoSchedule'"),
    ("model-volume-both", _set(("spec", "modelVolume"), {"claimName": "w", "hostPath": "/w"}),
     "spec.modelVolume", "exactly one"),
    ("model-volume-relative", _set(("spec", "modelVolume"), {"hostPath": "models"}),
     "spec.modelVolume.hostPath", "pattern"),
    ("master-port-zero", _set(("spec", "master"), {"apiPort": 0}), "spec.master.apiPort", "greater than or equal to 1"),
    ("heartbeat-timeout-below-two-intervals", _set(("spec", "heartbeat"), {"intervalSeconds": 1, "timeoutSeconds": 1.5}),
     "spec.heartbeat.timeoutSeconds", "at least twice intervalSeconds (1), got 1.5"),
    ("heartbeat-timeout-below-default-intervals", _set(("spec", "heartbeat"), {"timeoutSeconds": 0.6}),
     "spec.heartbeat.timeoutSeconds", "at least twice intervalSeconds (0.5)"),
    ("heartbeat-zero-interval", _set(("spec", "heartbeat"), {"intervalSeconds": 0}),
     "spec.heartbeat.intervalSeconds", "greater than 0"),
    ("heartbeat-unknown-field", _set(("spec", "heartbeat"), {"periodSeconds": 1}),
     "spec.heartbeat.periodSeconds", "unknown field"),
    ("master-service-type", _set(("spec", "master"), {"serviceType": "External"}),
     "spec.master.serviceType", "'ClusterIP'"),
    ("pipeline-name-dots", _set(("metadata", "name"), "my.pipeline"), "metadata.name", "DNS label"),
    ("pipeline-name-digit", _set(("metadata", "name"), "1pipeline"), "metadata.name", "DNS label"),
    ("pipeline-name-too-long", _set(("metadata", "name"), "p" * 60), "metadata.name", "too long by 5"),
    ("stage-plus-pipeline-too-long", _many(_set(("metadata", "name"), "p" * 30), _set(S + (0, "name"), "t" * 40),
                                           _set(S + (1, "inputs"), ["t" * 40])),
     "spec.stages[0].name", "too long by 8"),
    ("reserved-stage-name", _many(_set(S + (0, "name"), "master"), _set(S + (1, "inputs"), ["master"])),
     "spec.stages[0].name", "reserved"),
    ("volume without source", _set(S + (2, "volumes"), [{"name": "code"}]),
     "spec.stages[2].volumes[0]", "exactly one volume source"),
    ("volume with two sources", _set(S + (2, "volumes"), [{"name": "code", "configMap": {"name": "c"}, "emptyDir": {}}]),
     "spec.stages[2].volumes[0]", "exactly one volume source"),
    ("hostPath volume", _set(S + (2, "volumes"), [{"name": "code", "hostPath": {"path": "/x"}}]),
     "spec.stages[2].volumes[0].hostPath", "unknown field"),
    ("reserved volume name", _set(S + (0, "volumes"), [{"name": "config", "emptyDir": {}}]),
     "spec.stages[0].volumes[0].name", "operator mounts itself"),
    ("mount of a missing volume", _set(S + (0, "volumeMounts"), [{"name": "nope", "mountPath": "/code"}]),
     "spec.stages[0].volumeMounts[0].name", "no volume named 'nope'"),
    ("mount over /tmp", _many(_set(S + (0, "volumes"), [{"name": "c", "emptyDir": {}}]),
                              _set(S + (0, "volumeMounts"), [{"name": "c", "mountPath": "/tmp/x"}])),
     "spec.stages[0].volumeMounts[0].mountPath", "overlaps /tmp"),
    ("relative mount path", _many(_set(S + (0, "volumes"), [{"name": "c", "emptyDir": {}}]),
                                  _set(S + (0, "volumeMounts"), [{"name": "c", "mountPath": "code"}])),
     "spec.stages[0].volumeMounts[0].mountPath", "pattern"),
    ("duplicate volume in a pod", _many(_set(S + (1, "volumes"), [{"name": "c", "emptyDir": {}}]),
                                        _set(S + (2, "volumes"), [{"name": "c", "emptyDir": {}}])),
     "spec.stages[2].volumes[0].name", "duplicate volume name 'c'"),
    ("prompt expansion on a streaming stage", _set(S + (2, "promptExpand"), "pkg.cfg:expand"),
     "spec.stages[2].promptExpand", "set inputMode: whole"),
    ("prompt expansion whose companions go nowhere", _many(_set(S + (2, "promptExpand"), "pkg.cfg:expand"),
                                                            _set(S + (2, "inputMode"), "whole")),
     "spec.stages[2].promptExpand", "no stage takes this stage's output"),
    ("prompt expansion not a callable ref", _set(S + (0, "promptExpand"), "no colon"),
     "spec.stages[0].promptExpand", "pattern"),
    ("master mount of a missing volume", _set(("spec", "master"), {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}),
     "spec.master.volumeMounts[0].name", "no volume named 'x'"),
]


@pytest.mark.parametrize("mutate,path,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_pipeline_names_the_field(mutate, path, fragment):
    doc = base()
    mutate(doc)
    parsed, problems = check_document(doc)
    assert parsed is None
    matching = [p for p in problems if p.path == path]
    assert matching, f"no problem at {path}; got {[str(p) for p in problems]}"
    assert any(fragment in p.message for p in matching), [str(p) for p in matching]


def test_at_least_thirty_cases():
    assert len(CASES) >= 30


def test_cycle_is_named():
    doc = base()
    doc["spec"]["stages"].append({"name": "a", "type": "python", "entrypoint": "m:f", "inputs": ["b"]})
    doc["spec"]["stages"].append({"name": "b", "type": "python", "entrypoint": "m:f", "inputs": ["a"]})
    _, problems = check_document(doc)
    assert any("cycle" in p.message and ("a -> b -> a" in p.message or "b -> a -> b" in p.message)
               for p in problems), problems


def test_base_is_valid():
    parsed, problems = check_document(base())
    assert problems == [] and parsed is not None


VALID = {
    "single-stage": [{"name": "llm", "type": "llm", "finalOutput": "text"}],
    "fan-out": [
        {"name": "in", "type": "python", "entrypoint": "m:f"},
        {"name": "text", "type": "llm", "inputs": ["in"], "finalOutput": "text"},
        {"name": "image", "type": "diffusion", "inputs": ["in"], "finalOutput": "image"},
    ],
    "fan-in": [
        {"name": "in", "type": "python", "entrypoint": "m:f"},
        {"name": "a", "type": "llm", "inputs": ["in"]},
        {"name": "b", "type": "llm", "inputs": ["in"]},
        {"name": "join", "type": "python", "entrypoint": "m:join", "inputs": ["a", "b"], "finalOutput": "text"},
    ],
    "cpu-only-stage": [{"name": "tok", "type": "python", "entrypoint": "m:f", "gpus": 0, "finalOutput": "text"}],
    "gpu-shares-exactly-one": [
        {"name": "talker", "type": "llm", "engineArgs": {"gpu_memory_utilization": 0.6}, "finalOutput": "text"},
        {"name": "code2wav", "type": "llm", "colocateWith": "talker", "inputs": ["talker"],
         "engineArgs": {"gpu_memory_utilization": 0.4}, "finalOutput": "audio"},
    ],
    "zero-replicas": [{"name": "llm", "type": "llm", "replicas": 0, "finalOutput": "text"}],
    "int-quantities": [{"name": "llm", "type": "llm", "finalOutput": "text",
                        "resources": {"requests": {"cpu": 2, "memory": "8Gi"}, "limits": {"cpu": 2.5}}}],
}


@pytest.mark.parametrize("stages", VALID.values(), ids=VALID.keys())
def test_valid_edge_cases(stages):
    doc = base()
    doc["spec"]["stages"] = copy.deepcopy(stages)
    parsed, problems = check_document(doc)
    assert problems == [], [str(p) for p in problems]
    assert [s.name for s in parsed.spec.stages] == [s["name"] for s in stages]
