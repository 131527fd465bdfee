"""Case 8: a stage that fits on no node is reported (CapacityPending) until a node that fits
arrives (what the cluster autoscaler would add)."""

from __future__ import annotations

from omnifleet_operator.devcluster.cluster import kstatus

from .kube import LABEL_PIPELINE, Kube, condition, pipeline_doc, wait_for, with_namespace


def test_capacity_pending_until_a_node_fits(kube: Kube, operator, cluster, ns: str):
    doc = pipeline_doc("huge", [
        {"name": "prep", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough", "gpus": 0},
        {"name": "big", "type": "llm", "gpus": 16, "replicas": 1, "inputs": ["prep"], "finalOutput": "text"},
    ])
    kube.apply(with_namespace(doc, ns))
    p = kube.wait_condition(ns, "huge", "CapacityPending")
    ready = condition(p, "Ready")
    assert ready["status"] == "False"
    assert "stage big" in ready["message"] and "unschedulable" in ready["message"], ready
    assert "stage prep" not in ready["message"]
    assert p["status"]["phase"] == "Pending"
    assert condition(p, "Stalled")["status"] == "False"  # not terminal: capacity may come
    assert kstatus(p)["status"] == "InProgress"
    uid = p["metadata"]["uid"]
    wait_for(lambda: [e for e in kube.events(ns, uid) if e["reason"] == "CapacityPending" and e["type"] == "Warning"],
             30, "a Warning event CapacityPending")

    node = "gpu-16-0"
    cluster.add_node(node, gpus=16)
    try:
        p = kube.wait_ready(ns, "huge", timeout=90)
        pods = kube.list("Pod", ns, f"{LABEL_PIPELINE}=huge,omnifleet.dev/stage=big")
        assert [q["spec"]["nodeName"] for q in pods] == [node]
        assert kstatus(p)["status"] == "Current"
    finally:
        # Leave the GPU pool as it was. The pods go first, while kwok still serves the node
        # (pods of a deleted node linger until the pod GC's timeout); the Deployments are
        # deleted by hand because the garbage collector may not know OmniPipelines yet.
        kube.kubectl("delete", "omnipipeline", "huge", "-n", ns, "--wait=false")
        kube.kubectl("delete", "deployment", "-l", f"{LABEL_PIPELINE}=huge", "-n", ns, "--wait=false")
        wait_for(lambda: not kube.list("Pod", ns, f"{LABEL_PIPELINE}=huge"), 60, "huge's pods gone")
        cluster.remove_node(node)


def test_a_rollout_with_no_room_for_a_surge_pod_goes_one_replica_at_a_time(kube: Kube, operator, cluster, ns: str):
    """Two pods of 16 GPUs fill the only node that fits them: the rollout's surge pod finds no node, so the
    operator trades one old pod for a new one at a time, and puts the spec's policy back when done."""
    node = "gpu-32-0"
    pin = {"example.com/pool": "tight"}  # only this node: no other (one left by another test) may fit a pod
    cluster.add_node(node, gpus=32, labels=pin)
    doc = pipeline_doc("tight", [
        {"name": "prep", "type": "python", "entrypoint": "omnifleet_runtime.stock:passthrough", "gpus": 0},
        {"name": "big", "type": "llm", "gpus": 16, "replicas": 2, "inputs": ["prep"], "finalOutput": "text",
         "nodeSelector": pin},
    ])
    try:
        kube.apply(with_namespace(doc, ns))
        kube.wait_ready(ns, "tight", timeout=90)
        selector = f"{LABEL_PIPELINE}=tight,omnifleet.dev/stage=big"
        before = {q["metadata"]["name"] for q in kube.list("Pod", ns, selector)}
        doc["spec"]["stages"][1]["engineArgs"] = {"max_num_seqs": 4}
        kube.apply(with_namespace(doc, ns))
        generation = kube.pipeline(ns, "tight")["metadata"]["generation"]

        def strategy():
            return kube.get("Deployment", ns, "tight-big")["spec"]["strategy"]["rollingUpdate"]

        # kwok's pods are ready at once, so the switch may last less than a poll: its log line stays.
        wait_for(lambda: "rolling one replica at a time: tight-big" in operator.log.read_text(errors="replace"),
                 60, lambda: f"the operator to roll one replica at a time: {strategy()}")
        kube.wait_ready(ns, "tight", timeout=120, generation=generation)
        wait_for(lambda: strategy() == {"maxSurge": 1, "maxUnavailable": 0}, 60,
                 lambda: f"the spec's policy back: {strategy()}")
        pods = [q for q in kube.list("Pod", ns, selector) if not q["metadata"].get("deletionTimestamp")]
        assert len(pods) == 2 and not before & {q["metadata"]["name"] for q in pods}
        assert {q["spec"]["nodeName"] for q in pods} == {node}
    finally:
        kube.kubectl("delete", "omnipipeline", "tight", "-n", ns, "--wait=false")
        kube.kubectl("delete", "deployment", "-l", f"{LABEL_PIPELINE}=tight", "-n", ns, "--wait=false")
        wait_for(lambda: not kube.list("Pod", ns, f"{LABEL_PIPELINE}=tight"), 60, "tight's pods gone")
        cluster.remove_node(node)
