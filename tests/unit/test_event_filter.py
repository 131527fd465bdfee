"""Which watch events of children queue their pipeline for another pass."""

from __future__ import annotations

import copy

import pytest

from omnifleet_operator import handlers
from omnifleet_runtime import constants as C


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(handlers, "STATE", handlers.State())


def obj(uid="u1", generation=1, labels=None, status=None, rv="1"):
    return {"metadata": {"uid": uid, "generation": generation, "resourceVersion": rv,
                         "labels": labels or {"omnifleet.dev/pipeline": "p"}},
            "status": status or {}}


def pod(uid="p1", phase="Pending", scheduled=None):
    conds = [] if scheduled is None else [{"type": "PodScheduled", "status": scheduled[0], "reason": scheduled[1]}]
    return {"metadata": {"uid": uid, "resourceVersion": phase}, "status": {"phase": phase, "conditions": conds}}


def matters(kind, body, event_type="MODIFIED"):
    return handlers._matters({"type": event_type}, body, kind)


def test_status_updates_of_a_pdb_or_hpa_do_not_queue_a_pass():
    spec = handlers._spec_fingerprint
    first = obj(status={"currentHealthy": 0})
    assert matters(spec, first, "ADDED")
    assert not matters(spec, obj(status={"currentHealthy": 2}, rv="2"))  # the disruption controller's update
    assert matters(spec, obj(generation=2, rv="3"))  # someone changed its spec
    assert matters(spec, obj(generation=2, labels={"omnifleet.dev/pipeline": "p", "x": "y"}, rv="4"))
    assert matters(spec, obj(generation=2, rv="5"), "DELETED")
    assert matters(spec, obj(generation=2, rv="6"), "ADDED")  # the same uid seen again starts afresh


def test_objects_without_generation_count_every_change():
    cm = obj()
    del cm["metadata"]["generation"]
    assert matters(handlers._spec_fingerprint, cm, "ADDED")
    changed = copy.deepcopy(cm)
    changed["metadata"]["resourceVersion"] = "2"
    assert matters(handlers._spec_fingerprint, changed)


def test_deployments_always_queue_their_pipeline():
    assert all(matters(None, obj(status={"readyReplicas": n})) for n in range(3))


def test_pods_queue_a_pass_only_when_their_scheduling_changes():
    sched = handlers._scheduling
    assert matters(sched, pod(), "ADDED")
    assert matters(sched, pod(scheduled=("False", "Unschedulable")))
    assert not matters(sched, pod(phase="Pending", scheduled=("False", "Unschedulable")))
    assert matters(sched, pod(scheduled=("True", None)))
    assert not matters(sched, pod(phase="Running", scheduled=("True", None)))
    assert matters(sched, pod(phase="Running", scheduled=("True", None)), "DELETED")


def test_the_pod_index_keeps_what_status_and_rollouts_read_a_revision_and_a_deletion():
    labels = {C.LABEL_PIPELINE: "p", C.LABEL_STAGE: "thinker"}
    body = {"metadata": {"name": "p-thinker-x", "labels": labels, "uid": "u", "resourceVersion": "9",
                         "annotations": {C.ANNOTATION_TEMPLATE_HASH: "abc", "other": "dropped"},
                         "deletionTimestamp": "2026-12-02T00:00:00Z"},
            "spec": {"containers": [{"name": "stage"}]}, "status": {"phase": "Running"}}
    kept = handlers._keep_pod(body)
    assert kept["metadata"] == {"name": "p-thinker-x", "labels": labels, "deletionTimestamp": "2026-12-02T00:00:00Z",
                                "resourceVersion": "9",
                                "annotations": {C.ANNOTATION_TEMPLATE_HASH: "abc"}}
    going = {**body, "metadata": {**body["metadata"], "deletionTimestamp": None}}
    assert handlers._scheduling(going) != handlers._scheduling(body)  # a pod starting to go queues a pass


def test_a_kept_deployment_holds_what_status_and_rollouts_read_and_no_unique_noise():
    from omnifleet_operator import status as st

    body = {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "p-thinker", "uid": "u", "resourceVersion": "9", "generation": 2,
                         "creationTimestamp": "2026-12-03T00:00:00Z", "managedFields": [{"manager": "x"}],
                         "labels": {C.LABEL_PIPELINE: "p"}},
            "spec": {"replicas": 2},
            "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1,
                       "availableReplicas": 1, "collisionCount": 0,
                       "conditions": [
                           {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                            "message": 'ReplicaSet "p-thinker-5d8f" has successfully progressed.',
                            "lastUpdateTime": "2026-12-03T00:00:01Z", "lastTransitionTime": "2026-12-03T00:00:00Z"},
                           {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                            "message": "pods is forbidden: exceeded quota",
                            "lastUpdateTime": "2026-12-03T00:00:02Z", "lastTransitionTime": "2026-12-03T00:00:02Z"}]}}
    kept = handlers._keep(copy.deepcopy(body), deployment=True)
    assert "creationTimestamp" not in kept["metadata"] and "managedFields" not in kept["metadata"]
    assert kept["metadata"]["generation"] == 2 and kept["spec"] == {"replicas": 2}
    assert kept["status"] == {
        "observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1,
        "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
                       {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                        "message": "pods is forbidden: exceeded quota"}]}
    view = st.StageView("thinker", "p-thinker", 2, kept)
    verdict = st.check_failures([view], st.Observed())
    assert verdict is not None and "exceeded quota" in verdict.message  # the message status quotes is kept
    assert "status" not in handlers._keep(copy.deepcopy(body), deployment=False)
