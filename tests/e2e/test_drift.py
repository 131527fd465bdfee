"""Case 10: hand edits of fields the operator owns are put back; fields it does not own are left alone."""

from __future__ import annotations

import yaml

from .kube import Kube, describe_writes, idle_period, is_ready, load_sample, operator_writes, wait_for, with_namespace


def test_owned_fields_are_restored_foreign_fields_kept(kube: Kube, operator, cluster, ns: str):
    doc = load_sample("single.yaml")
    kube.apply(with_namespace(doc, ns))
    uid = kube.wait_ready(ns, "chat")["metadata"]["uid"]
    # Settled: the Ready event follows the Ready status.
    wait_for(lambda: [e for e in kube.events(ns, uid) if e["reason"] == "Ready"], 30, "the Ready event")
    dep = kube.get("Deployment", ns, "chat-master")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    text = kube.get("ConfigMap", ns, "chat-config")["data"]["pipeline.yaml"]
    assert yaml.safe_load(text)["metadata"]["name"] == "chat"

    # Not owned: an annotation another tool adds to the Deployment, a label on the ConfigMap.
    kube.kubectl("annotate", "deployment", "chat-master", "-n", ns, "example.com/owner=other-tool")
    kube.kubectl("label", "configmap", "chat-config", "-n", ns, "example.com/team=infra")
    mark = cluster.audit_lines()
    idle_period(3, "the operator must leave fields it does not own alone")
    assert kube.get("Deployment", ns, "chat-master")["metadata"]["annotations"].get("example.com/owner") == "other-tool"
    assert kube.get("ConfigMap", ns, "chat-config")["metadata"]["labels"].get("example.com/team") == "infra"
    # The operator wrote neither object. (It may write the pipeline's status: an annotation
    # bumps a Deployment's generation, which is briefly not observed, i.e. rolling out.)
    touched = [w for w in operator_writes(cluster, mark, ns)
               if (w["objectRef"].get("resource"), w["objectRef"].get("name")) in
               (("deployments", "chat-master"), ("configmaps", "chat-config"))]
    assert not touched, describe_writes(touched)

    # Owned: the container image and the ConfigMap's data are put back.
    kube.kubectl("set", "image", "deployment/chat-master", "master=evil.example/other:1", "-n", ns)
    kube.kubectl("patch", "configmap", "chat-config", "-n", ns, "--type=merge",
                 "-p", '{"data": {"pipeline.yaml": "hacked: true\\n"}}')

    def image_now():
        return kube.get("Deployment", ns, "chat-master")["spec"]["template"]["spec"]["containers"][0]["image"]

    wait_for(lambda: image_now() == image, 30, lambda: f"the image put back (now {image_now()})")
    wait_for(lambda: kube.get("ConfigMap", ns, "chat-config")["data"]["pipeline.yaml"] == text, 30,
             "the config put back")

    def settled():
        d = kube.get("Deployment", ns, "chat-master")
        s = d.get("status") or {}
        pods = [p for p in kube.list("Pod", ns, "omnifleet.dev/pipeline=chat,omnifleet.dev/component=master")]
        return (s.get("observedGeneration") == d["metadata"]["generation"]
                and s.get("updatedReplicas") == s.get("readyReplicas") == s.get("replicas") == 1
                and [p["spec"]["containers"][0]["image"] for p in pods] == [image]
                and is_ready(kube.pipeline(ns, "chat")))

    wait_for(settled, 60, "the master rolled back to its image and the pipeline Ready")
    # The restoring apply took back only what the operator owns: the other tools' fields stay.
    assert kube.get("Deployment", ns, "chat-master")["metadata"]["annotations"].get("example.com/owner") == "other-tool"
    assert kube.get("ConfigMap", ns, "chat-config")["metadata"]["labels"].get("example.com/team") == "infra"
