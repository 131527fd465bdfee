"""Cases 6 and 9: deleting a pipeline garbage-collects every child; an operator
killed mid-reconcile leaves neither duplicates nor orphans, and an idle operator
writes nothing. A pass racing its namespace's deletion reports no failure.

Writes are counted from the API server's audit log (by the operator's
ServiceAccount user): in Kubernetes 1.36 apiserver_request_total has no client
label, so /metrics cannot say who wrote.
"""

from __future__ import annotations

import logging

import pytest
from lightkube import AsyncClient, KubeConfig

from omnifleet_operator.reconcile import Api, AppliedCache, Children, reconcile
from omnifleet_operator.status import APPLY_FAILED

from .kube import (
    LABEL_PIPELINE, LABELLED_KINDS, OPERATOR_USER, RESYNC_S, Kube, describe_writes, idle_period, is_ready, key_of,
    load_sample, operator_writes, render, wait_for, wait_namespaces_gone, weights, with_namespace,
)


def test_delete_pipeline_garbage_collects_children(kube: Kube, operator, gc_ready, ns: str):
    kube.apply(with_namespace(load_sample("autoscaled.yaml"), ns))
    kube.wait_ready(ns, "autoscaled")
    before = kube.children(ns, "autoscaled", LABELLED_KINDS)
    kinds = {o["kind"] for o in before}
    assert {"Deployment", "ReplicaSet", "Pod", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ConfigMap", "ServiceAccount", "NetworkPolicy"} <= kinds, kinds

    kube.kubectl("delete", "omnipipeline", "autoscaled", "-n", ns, "--wait=false")

    def leftovers():
        return [f"{o['kind']}/{o['metadata']['name']}" for o in kube.children(ns, "autoscaled", LABELLED_KINDS)]

    wait_for(lambda: not leftovers(), 90, lambda: f"every child gone (left: {leftovers()})")
    assert kube.pipeline(ns, "autoscaled") is None


def test_restart_mid_reconcile_then_idle(kube: Kube, operator, cluster, ns: str, capsys: pytest.CaptureFixture):
    weights(kube, ns)
    doc = load_sample("speech.yaml")
    kube.apply(with_namespace(doc, ns))
    # Kill the operator as soon as it has begun creating children (SIGKILL: no clean-up).
    wait_for(lambda: kube.children(ns, "speech", ("ServiceAccount", "ConfigMap", "NetworkPolicy", "Deployment")),
             30, "the first child", interval=0.02)
    operator.kill()
    at_kill = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in kube.children(ns, "speech"))
    operator.start()

    p = kube.wait_ready(ns, "speech")
    uid = p["metadata"]["uid"]
    want = {key_of(o) for o in render(doc, ns)}
    live = kube.children(ns, "speech")
    keys = [key_of(o) for o in live]
    assert len(keys) == len(set(keys)), f"duplicates: {keys}"
    assert set(keys) == want, f"missing {want - set(keys)}, extra {set(keys) - want} (at kill: {at_kill})"
    for o in live:
        refs = o["metadata"].get("ownerReferences") or []
        assert [(r["uid"], r.get("controller")) for r in refs] == [(uid, True)], (key_of(o), refs)
    # No stray generations below the Deployments either.
    deployments = [o for o in live if o["kind"] == "Deployment"]
    rs = kube.list("ReplicaSet", ns, f"{LABEL_PIPELINE}=speech")
    assert len(rs) == len(deployments), [r["metadata"]["name"] for r in rs]
    pods = [q for q in kube.list("Pod", ns, f"{LABEL_PIPELINE}=speech") if not q["metadata"].get("deletionTimestamp")]
    assert len(pods) == sum(d["spec"]["replicas"] for d in deployments)

    # Idle: nothing to do, so nothing written, over several resync periods (the whole cluster counted).
    wait_namespaces_gone(kube)
    kube.wait_ready(ns, "speech")
    mark = cluster.audit_lines()
    seconds = idle_period(4, "an idle operator must make no write request")
    writes = operator_writes(cluster, mark)
    with capsys.disabled():
        print(f"\n[idle resync] {len(writes)} write request(s) by {OPERATOR_USER} in {seconds:.0f}s "
              f"({seconds / RESYNC_S:.1f} resync periods of {RESYNC_S:.0f}s); children at kill: {len(at_kill)}")
    assert writes == [], describe_writes(writes)
    assert is_ready(kube.pipeline(ns, "speech"))


@pytest.mark.parametrize("keys", ["to make", "kept"])
async def test_a_pass_in_a_namespace_being_deleted_makes_nothing_and_reports_no_failure(
        kube: Kube, cluster, ns: str, caplog: pytest.LogCaptureFixture, keys: str):
    """The race of a pass that read its pipeline before the namespace's deletion: every create is refused
    (NamespaceTerminating), the keys Secret's or ("kept": one an earlier pass made) the other children's.
    That is no apply failure to report, retry or warn of: the namespace's deletion takes the pipeline with
    it. Finalizers hold the namespace Terminating and the pipeline stored."""
    hold = "omnifleet.test/hold"
    doc = with_namespace(load_sample("single.yaml"), ns)
    name = doc["metadata"]["name"]
    doc["metadata"]["finalizers"] = [hold]
    kube.apply([doc, {"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": "hold", "namespace": ns, "finalizers": [hold]}}])
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    api, children = Api(client), Children()
    try:
        if keys == "kept":
            await reconcile(api, kube.pipeline(ns, name), Children(), cache=AppliedCache())  # or the operator did
            children.objects = [{**o, "apiVersion": "v1", "kind": "Secret"}  # a list's items carry neither
                                for o in kube.list("Secret", ns, f"{LABEL_PIPELINE}={name}")]
            assert children.objects, "the keys Secret"
        kube.kubectl("delete", "namespace", ns, "--wait=false")
        wait_for(lambda: (kube.pipeline(ns, name) or {}).get("metadata", {}).get("deletionTimestamp"), 60,
                 "the namespace's deletion reached the pipeline")
        wait_for(lambda: not kube.children(ns, name, LABELLED_KINDS), 90, "no child of the pipeline left")
        body = kube.pipeline(ns, name)
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):  # as read before the deletion
            body["metadata"].pop(key, None)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="omnifleet.reconcile"):
            first = await reconcile(api, body, children, cache=AppliedCache())
            again = await reconcile(api, body, children, last_status=first.status, cache=AppliedCache())
        assert first.applied == first.deleted == 0
        reasons = {c["type"]: c["reason"] for c in first.status["conditions"]}
        assert APPLY_FAILED not in reasons.values(), reasons
        assert again.steady, "a pass that can make nothing in a namespace being deleted is retried"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not warnings, warnings
        assert any("namespace is being deleted" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        await client.close()
        for kind, obj in (("omnipipeline", name), ("configmap", "hold")):
            kube.kubectl("patch", kind, obj, "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                         check=False)
