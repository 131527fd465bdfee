"""Case 7: invalid specs. What the CRD can say is refused by the API server, naming the
field; the rest is accepted there and reported by the operator (Ready=False InvalidSpec,
Stalled=True, a Warning event) with nothing created, until the spec is fixed."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from omnifleet_operator.devcluster.cluster import kstatus

from .kube import (
    CHILD_KINDS, Kube, condition, describe_writes, idle_period, is_ready, key_of, operator_writes, pipeline_doc,
    wait_for, with_namespace,
)

PY = "omnifleet_runtime.stock:passthrough"


def _base() -> dict:
    return pipeline_doc("bad", [
        {"name": "first", "type": "llm", "gpus": 1, "finalOutput": "text"},
        {"name": "second", "type": "python", "entrypoint": PY, "gpus": 0, "inputs": ["first"]},
    ])


def _mutate(path: list, value) -> dict:
    doc = _base()
    node = doc["spec"]
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return doc


CRD_CASES = {
    "bad-stage-name": (_mutate(["stages", 0, "name"], "First_1"), "spec.stages[0].name", "should match"),
    "negative-gpus": (_mutate(["stages", 0, "gpus"], -1), "spec.stages[0].gpus",
                      "should be greater than or equal to 0"),
    "unknown-type": (_mutate(["stages", 0, "type"], "tts"), "spec.stages[0].type", 'Unsupported value: "tts"'),
    "duplicate-names": (_mutate(["stages", 1, "name"], "first"), "spec:", "stage names must be unique"),
    "missing-input": (_mutate(["stages", 1, "inputs"], ["nowhere"]), "spec:",
                      "every input must name a stage of this pipeline"),
    "python-without-entrypoint": (_mutate(["stages", 1, "entrypoint"], None), "spec.stages[1]:",
                                  "entrypoint is required for python and torch stages"),
    "min-over-max": (_mutate(["stages", 1, "autoscaling"], {"minReplicas": 5, "maxReplicas": 2}),
                     "spec.stages[1].autoscaling", "minReplicas must not exceed maxReplicas"),
}


@pytest.fixture(scope="module")
def reject_ns(kube: Kube):
    name = "e2e-crd-rejects"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("case", sorted(CRD_CASES))
def test_api_server_refuses(kube: Kube, reject_ns: str, case: str):
    doc, field, message = CRD_CASES[case]
    doc = copy.deepcopy(doc)
    doc["spec"]["stages"] = [{k: v for k, v in s.items() if v is not None} for s in doc["spec"]["stages"]]
    r = kube.kubectl("create", "-n", reject_ns, "-f", "-", input=json.dumps(doc), check=False)
    assert r.returncode != 0, f"{case}: accepted"
    assert field in r.stderr and message in r.stderr, r.stderr
    assert kube.pipeline(reject_ns, "bad") is None


def _llm(name: str, **kw) -> dict:
    return {"name": name, "type": "llm", "gpus": 1, **kw}


# Accepted by the API server, refused by the operator: (doc, field path in the message, fix as JSON patch)
OPERATOR_CASES = {
    "cycle": (
        pipeline_doc("cycle", [_llm("a", finalOutput="text"), _llm("b", inputs=["a", "c"]), _llm("c", inputs=["b"])]),
        "spec.stages[1].inputs", "cycle",
        [{"op": "replace", "path": "/spec/stages/1/inputs", "value": ["a"]}],
    ),
    "gpu-share": (
        pipeline_doc("share", [
            _llm("host", finalOutput="text", engineArgs={"gpu_memory_utilization": 0.7}),
            {"name": "side", "type": "llm", "colocateWith": "host", "inputs": ["host"], "finalOutput": "audio",
             "engineArgs": {"gpu_memory_utilization": 0.5}},
        ]),
        "spec.stages[0].engineArgs.gpu_memory_utilization", "1.20 > 1.0",
        [{"op": "replace", "path": "/spec/stages/1/engineArgs/gpu_memory_utilization", "value": 0.2}],
    ),
    "long-name": (
        pipeline_doc("a-rather-long-pipeline-name", [_llm("stage-with-a-rather-long-descriptive-name",
                                                          finalOutput="text")]),
        "spec.stages[0].name", "too long by 6",
        [{"op": "replace", "path": "/spec/stages/0/name", "value": "short"}],
    ),
}


def test_operator_refuses_creates_nothing_until_fixed(kube: Kube, operator, cluster, ns: str):
    mark = cluster.audit_lines()
    for doc, *_ in OPERATOR_CASES.values():
        kube.apply(with_namespace(doc, ns))  # the API server accepts them
    for case, (doc, field, message, _fix) in OPERATOR_CASES.items():
        name = doc["metadata"]["name"]
        p = kube.wait_condition(ns, name, "InvalidSpec")
        ready, stalled = condition(p, "Ready"), condition(p, "Stalled")
        assert ready["status"] == "False" and field in ready["message"] and message in ready["message"], (case, ready)
        assert stalled["status"] == "True" and stalled["reason"] == "InvalidSpec", (case, stalled)
        assert condition(p, "Reconciling")["status"] == "False"
        assert p["status"]["phase"] == "Invalid" and field in p["status"]["message"]
        assert kstatus(p)["status"] == "Failed", (case, kstatus(p))
        uid = p["metadata"]["uid"]
        warned = wait_for(lambda: [e for e in kube.events(ns, uid)
                                   if e["reason"] == "InvalidSpec" and e["type"] == "Warning"],
                          30, f"{case}: a Warning event InvalidSpec")
        assert field in warned[0]["message"]
        assert kube.children(ns, name) == [], case
    # Nothing created: the operator wrote only statuses and events in this namespace.
    writes = operator_writes(cluster, mark, ns)
    other = [w for w in writes if (w["objectRef"].get("resource"), w["objectRef"].get("subresource"))
             not in (("omnipipelines", "status"), ("events", None))]
    assert not other, describe_writes(other)

    for case, (doc, _field, _message, fix) in OPERATOR_CASES.items():
        kube.patch_json("omnipipeline", ns, doc["metadata"]["name"], fix)
    for case, (doc, *_rest) in OPERATOR_CASES.items():
        name = doc["metadata"]["name"]
        p = kube.wait_ready(ns, name)
        assert condition(p, "Stalled")["status"] == "False"
        hosts = [s for s in p["spec"]["stages"] if not s.get("colocateWith")]
        deployments = kube.children(ns, name, ("Deployment",))
        assert len(deployments) == len(hosts) + 1, (case, [key_of(d) for d in deployments])


def test_valid_pipeline_made_invalid_keeps_its_children(kube: Kube, operator, cluster, ns: str):
    doc = pipeline_doc("steady", [_llm("llm", finalOutput="text", replicas=2)])
    kube.apply(with_namespace(doc, ns))
    p = kube.wait_ready(ns, "steady")
    gen = p["metadata"]["generation"]

    def snapshot():
        return {key_of(o): (o["metadata"]["uid"], o["metadata"]["resourceVersion"],
                            o["metadata"].get("generation")) for o in kube.children(ns, "steady", CHILD_KINDS)}

    before = snapshot()
    pods = kube.pods_by_component(ns, "steady")
    mark = cluster.audit_lines()
    kube.patch_json("omnipipeline", ns, "steady", [
        {"op": "add", "path": "/spec/stages/0/engineArgs", "value": {"gpu_memory_utilization": 1.5}}])
    p = kube.wait_condition(ns, "steady", "InvalidSpec")
    assert p["metadata"]["generation"] == gen + 1
    assert "spec.stages[0].engineArgs.gpu_memory_utilization" in condition(p, "Ready")["message"]
    assert p["status"]["stages"], "the last seen stage status is kept"
    idle_period(2, "an invalid update must not touch the running children")
    assert snapshot() == before
    assert kube.pods_by_component(ns, "steady") == pods
    writes = [w for w in operator_writes(cluster, mark, ns)
              if (w["objectRef"].get("resource"), w["objectRef"].get("subresource"))
              not in (("omnipipelines", "status"), ("events", None))]
    assert not writes, describe_writes(writes)

    config = kube.get("ConfigMap", ns, "steady-config")["data"]["pipeline.yaml"]
    kube.patch_json("omnipipeline", ns, "steady", [{"op": "remove", "path": "/spec/stages/0/engineArgs"}])
    p = kube.wait_ready(ns, "steady", generation=gen + 2)
    # Back to the same spec: nothing to change but the mounted config's generation (which orders the
    # pipeline's revisions); no pod rolls.
    wait_for(lambda: yaml.safe_load(kube.get("ConfigMap", ns, "steady-config")["data"]["pipeline.yaml"])
             ["metadata"].get("generation") == gen + 2, 30, "the config to carry the new generation")
    after = kube.get("ConfigMap", ns, "steady-config")["data"]["pipeline.yaml"]
    assert after.replace(f"generation: {gen + 2}", f"generation: {gen}") == config
    config_key = next(k for k in before if k[0] == "ConfigMap")
    assert is_ready(p) and {k: v for k, v in snapshot().items() if k != config_key} == {
        k: v for k, v in before.items() if k != config_key}
    assert kube.pods_by_component(ns, "steady") == pods
