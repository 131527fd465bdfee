"""Case 2: every shipped sample pipeline gets all its children, lands on the right
nodes and reports Ready (kubectl wait, kstatus)."""

from __future__ import annotations

import pytest

from omnifleet_operator.devcluster.cluster import kstatus

from .kube import (
    LABEL_PIPELINE, SAMPLE_FILES, Kube, key_of, load_sample, render, weights, with_namespace,
)

GPU_LABEL = "nvidia.com/gpu.present"


@pytest.fixture(scope="module")
def samples_ns(cluster, kube: Kube, operator):
    """All samples in one namespace (one weights claim serves those with a modelVolume)."""
    name = "e2e-samples"
    kube.kubectl("create", "namespace", name)
    docs = {}
    try:
        for path in SAMPLE_FILES:
            doc = load_sample(path.name)
            claim = (doc["spec"].get("modelVolume") or {}).get("claimName")
            if claim and not kube.get("PersistentVolumeClaim", name, claim):
                weights(kube, name, claim)
            kube.apply(with_namespace(doc, name))
            docs[path.name] = doc
        yield name, docs
    finally:
        kube.kubectl("delete", "omnipipelines", "--all", "-n", name, "--wait=false", check=False)
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("sample", [p.name for p in SAMPLE_FILES])
def test_sample_pipeline(kube: Kube, samples_ns, sample: str):
    ns, docs = samples_ns
    doc = docs[sample]
    name = doc["metadata"]["name"]
    p = kube.wait_ready(ns, name)
    uid, gen = p["metadata"]["uid"], p["metadata"]["generation"]

    # Status: Ready at the current generation, on every condition too.
    st = p["status"]
    assert st["observedGeneration"] == gen and st["phase"] == "Ready"
    assert st["readyStages"] == f"{len(doc['spec']['stages'])}/{len(doc['spec']['stages'])}"
    for c in st["conditions"]:
        assert c["observedGeneration"] == gen, c
    expected = {c["type"]: c["status"] for c in st["conditions"]}
    assert expected == {"Ready": "True", "Progressing": "False", "Degraded": "False",
                        "Reconciling": "False", "Stalled": "False"}

    # Every rendered child exists, with the controller owner reference and the labels.
    want = {key_of(o): o for o in render(doc, ns)}
    live = {key_of(o): o for o in kube.children(ns, name)}
    assert set(live) == set(want), f"missing {set(want) - set(live)}, extra {set(live) - set(want)}"
    for key, obj in live.items():
        refs = obj["metadata"].get("ownerReferences") or []
        assert len(refs) == 1, (key, refs)
        assert refs[0]["uid"] == uid and refs[0]["controller"] is True and refs[0]["kind"] == "OmniPipeline", refs
        labels = obj["metadata"]["labels"]
        for k, v in want[key]["metadata"]["labels"].items():
            assert labels.get(k) == v, (key, k, labels)
        assert labels[LABEL_PIPELINE] == name and labels["app.kubernetes.io/managed-by"] == "omnifleet-operator"
    deployments = {n for (k, n) in want if k == "Deployment"}
    assert f"{name}-master" in deployments

    # Pods: stage pods that ask for GPUs run on GPU nodes; CPU-only ones may land anywhere.
    nodes = {n["metadata"]["name"]: n for n in kube.list("Node")}
    pods = [q for q in kube.list("Pod", ns, f"{LABEL_PIPELINE}={name}") if not q["metadata"].get("deletionTimestamp")]
    replicas = sum(d["spec"]["replicas"] for d in kube.children(ns, name, ("Deployment",)))
    assert len(pods) == replicas
    for pod in pods:
        node = pod["spec"].get("nodeName")
        assert node in nodes, pod["metadata"]["name"]
        limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
        gpus = int(limits.get("nvidia.com/gpu", "0"))
        if gpus:
            assert nodes[node]["metadata"]["labels"].get(GPU_LABEL) == "true", (pod["metadata"]["name"], node)
            assert int(nodes[node]["status"]["allocatable"]["nvidia.com/gpu"]) >= gpus

    # What kubectl and Flux make of it.
    r = kube.kubectl("wait", "--for=condition=Ready", f"omnip/{name}", "-n", ns, "--timeout=30s", check=False,
                     timeout=40)
    assert r.returncode == 0, r.stderr
    assert kstatus(p)["status"] == "Current", kstatus(p)
