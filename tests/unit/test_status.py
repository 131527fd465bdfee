"""Status from observed children: a table of situations, each with its verdict."""

from __future__ import annotations

import pytest
import yaml

from omnifleet_operator.checks import check_document
from omnifleet_operator.status import (Observed, compute_status, decisive, refusals, transition_events,
                                       wants_master_report)
from omnifleet_runtime.validate import Problem

from ..conftest import REPO

T0, T1 = "2026-11-30T00:00:00Z", "2026-11-30T00:05:00Z"


def speech():
    doc, problems = check_document(yaml.safe_load((REPO / "manifests/samples/speech.yaml").read_text()))
    assert not problems
    return doc


def dep(name, want, ready=None, updated=None, replicas=None, generation=1, observed=1, conditions=()):
    ready = want if ready is None else ready
    return name, {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": want},
        "status": {"replicas": want if replicas is None else replicas, "readyReplicas": ready,
                   "updatedReplicas": want if updated is None else updated, "observedGeneration": observed,
                   "conditions": list(conditions)},
    }


def all_ready(**over):
    deps = dict([dep("speech-master", 1), dep("speech-thinker", 2), dep("speech-talker", 2)])
    for name, d in over.items():
        deps[name] = d
    return deps


def pod(stage, unschedulable=False):
    conds = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
              "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}] if unschedulable else []
    return {"metadata": {"name": f"{stage}-x", "labels": {"omnifleet.dev/stage": stage,
                                                          "omnifleet.dev/component": "stage"}},
            "status": {"conditions": conds}}


def status(observed, doc="default", problems=(), prior=None, generation=1, now=T0):
    return compute_status(name="speech", namespace="default", generation=generation,
                          doc=speech() if doc == "default" else doc, problems=list(problems),
                          observed=observed, prior=prior, now=now)


def cond(st, ctype):
    return next(c for c in st["conditions"] if c["type"] == ctype)


CASES = {
    # name: (observed, phase, Ready (status, reason), Stalled, Reconciling, message fragment)
    "all-ready": (Observed(all_ready()), "Ready", ("True", "AllStagesReady"), "False", "False", ""),
    "rollout-in-progress": (
        Observed(all_ready(**{"speech-thinker": dep("speech-thinker", 2, updated=1, replicas=3)[1]})),
        "Progressing", ("False", "RollingOut"), "False", "True", "thinker (1/2 updated)"),
    "deployment-not-yet-observed": (
        Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, generation=2, observed=1)[1]})),
        "Progressing", ("False", "RollingOut"), "False", "True", "talker"),
    "children-missing": (Observed({}), "Progressing", ("False", "Creating"), "False", "True",
                         "master, thinker, talker"),
    "stage-unschedulable": (
        Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, ready=0)[1]}),
                 pods=[pod("talker", unschedulable=True), pod("thinker")]),
        "Pending", ("False", "CapacityPending"), "False", "True", "stage talker: 1 pod(s) unschedulable"),
    "stage-zero-ready": (
        Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, ready=0)[1]})),
        "Progressing", ("False", "WaitingForReady"), "False", "True", "talker (0/2 ready)"),
    "replica-failure": (
        Observed(all_ready(**{"speech-thinker": dep("speech-thinker", 2, ready=0, conditions=[
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
             "message": "pods are forbidden: violates PodSecurity"}])[1]})),
        "Degraded", ("False", "ReplicaFailure"), "True", "False", "violates PodSecurity"),
    "progress-deadline": (
        Observed(all_ready(**{"speech-thinker": dep("speech-thinker", 2, ready=1, conditions=[
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}])[1]})),
        "Degraded", ("False", "ProgressDeadlineExceeded"), "True", "False", "thinker"),
}


@pytest.mark.parametrize("observed,phase,ready,stalled,reconciling,fragment", CASES.values(), ids=CASES.keys())
def test_status_table(observed, phase, ready, stalled, reconciling, fragment):
    st = status(observed)
    assert st["phase"] == phase
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ready
    assert cond(st, "Stalled")["status"] == stalled
    assert cond(st, "Reconciling")["status"] == reconciling
    assert fragment in cond(st, "Ready")["message"]
    assert st["observedGeneration"] == 1
    assert all(c["observedGeneration"] == 1 for c in st["conditions"])


def test_all_ready_summary():
    st = status(Observed(all_ready()))
    assert st["readyStages"] == "3/3"
    assert st["endpoint"] == "http://speech-master.default.svc:8000"
    code2wav = next(s for s in st["stages"] if s["name"] == "code2wav")
    assert code2wav == {"name": "code2wav", "host": "talker", "replicas": 2, "readyReplicas": 2,
                        "updatedReplicas": 2, "desiredReplicas": 2, "registeredReplicas": 2}


def test_invalid_spec():
    problems = [Problem("spec.stages[1].inputs[0]", "no stage named 'x'")]
    st = status(Observed(), doc=None, problems=problems, generation=4)
    assert st["phase"] == "Invalid" and st["observedGeneration"] == 4
    ready = cond(st, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.stages[1].inputs[0]: no stage named 'x'" in ready["message"]
    assert cond(st, "Stalled")["status"] == "True"
    assert cond(st, "Reconciling")["status"] == "False"


def test_lost_stage_after_ready_is_degraded_and_stays_so_until_it_recovers():
    ready = status(Observed(all_ready()))
    broken = Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, ready=0)[1]}))
    st = status(broken, prior=ready, now=T1)
    assert st["phase"] == "Degraded"
    assert cond(st, "Degraded")["status"] == "True" and cond(st, "Degraded")["reason"] == "StageUnavailable"
    st2 = status(broken, prior=st, now=T1)
    assert cond(st2, "Degraded")["status"] == "True"
    healed = status(Observed(all_ready()), prior=st2, now=T1)
    assert cond(healed, "Degraded")["status"] == "False" and healed["phase"] == "Ready"


def test_transition_time_is_stable_and_recomputation_is_identical():
    first = status(Observed(all_ready()), now=T0)
    again = status(Observed(all_ready()), prior=first, now=T1)
    assert again == first  # nothing changed: nothing to write
    flipped = status(Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, ready=1)[1]})),
                     prior=first, now=T1)
    assert cond(flipped, "Ready")["lastTransitionTime"] == T1
    assert cond(flipped, "Stalled")["lastTransitionTime"] == T0  # did not flip


def test_autoscaled_stage_desired_comes_from_the_live_deployment():
    doc, _ = check_document(yaml.safe_load((REPO / "manifests/samples/autoscaled.yaml").read_text()))
    deps = dict([dep("autoscaled-master", 1), dep("autoscaled-prep", 1), dep("autoscaled-llm", 5)])
    st = compute_status(name="autoscaled", namespace="default", generation=1, doc=doc, problems=[],
                        observed=Observed(deps), prior=None, now=T0)
    assert st["phase"] == "Ready"
    assert next(s for s in st["stages"] if s["name"] == "llm")["desiredReplicas"] == 5


def test_a_stage_that_may_scale_to_zero_is_idle_at_zero_not_missing():
    raw = yaml.safe_load((REPO / "manifests/samples/autoscaled.yaml").read_text())
    raw["spec"]["stages"][1]["autoscaling"]["minReplicas"] = 0
    doc, problems = check_document(raw)
    assert not problems

    def at(llm):
        deps = dict([dep("autoscaled-master", 1), dep("autoscaled-prep", 1), llm])
        return compute_status(name="autoscaled", namespace="default", generation=1, doc=doc, problems=[],
                              observed=Observed(deps), prior=None, now=T0)

    st = at(dep("autoscaled-llm", 0))
    assert st["phase"] == "Ready", st
    assert "llm scaled to zero: requests wait for a replica" in cond(st, "Ready")["message"]
    # Its last pod still terminating: not yet at zero.
    assert at(dep("autoscaled-llm", 0, replicas=1))["phase"] != "Ready"
    # A stage at zero without minReplicas 0 is not serving: ScaledToZero, not Ready.
    doc, _ = check_document(yaml.safe_load((REPO / "manifests/samples/autoscaled.yaml").read_text()))
    st = compute_status(name="autoscaled", namespace="default", generation=1, doc=doc, problems=[],
                        observed=Observed(dict([dep("autoscaled-master", 1), dep("autoscaled-prep", 1),
                                                dep("autoscaled-llm", 0)])), prior=None, now=T0)
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Ready")["reason"] == "ScaledToZero"


def test_several_masters_are_ready_only_when_all_are():
    raw = yaml.safe_load((REPO / "manifests/samples/speech.yaml").read_text())
    raw["spec"]["master"] = {"replicas": 2}
    doc, problems = check_document(raw)
    assert not problems
    assert status(Observed(all_ready(**dict([dep("speech-master", 2, ready=1)]))), doc=doc)["phase"] != "Ready"
    assert status(Observed(all_ready(**dict([dep("speech-master", 2)]))), doc=doc)["phase"] == "Ready"


def test_events_only_on_transitions():
    ready = status(Observed(all_ready()))
    assert [(e.type, e.reason) for e in transition_events(None, ready)] == [("Normal", "Ready")]
    assert transition_events(ready, ready) == []
    pending = status(Observed(all_ready(), pods=[pod("talker", unschedulable=True)]), prior=ready, now=T1)
    assert [(e.type, e.reason) for e in transition_events(ready, pending)] == [("Warning", "CapacityPending")]


def test_coming_up_posts_no_event_per_step_falling_back_does():
    creating = status(Observed({}))
    waiting = status(Observed(all_ready(**dict([dep("speech-talker", 2, ready=0)]))), prior=creating, now=T1)
    assert (cond(creating, "Ready")["reason"], cond(waiting, "Ready")["reason"]) == ("Creating", "WaitingForReady")
    assert transition_events(None, creating) == [] and transition_events(creating, waiting) == []
    ready = status(Observed(all_ready()), prior=waiting, now=T1)
    assert [e.reason for e in transition_events(waiting, ready)] == ["Ready"]
    fallen = status(Observed(all_ready(**dict([dep("speech-talker", 2, ready=1)]))), prior=ready, now=T1)
    assert [(e.type, e.reason) for e in transition_events(ready, fallen)] == [("Normal", "WaitingForReady")]
    # New Deployments not observed by their controller yet: RollingOut, yet no rollout of a running pipeline.
    first = status(Observed(all_ready(**{"speech-talker": dep("speech-talker", 2, generation=1, observed=0)[1]})),
                   prior=creating, now=T1)
    assert cond(first, "Ready")["reason"] == "RollingOut" and transition_events(creating, first) == []
    assert transition_events(None, first) == []  # its first status written (Creating held in a mass create)
    rolling = status(Observed(all_ready(**{"speech-thinker": dep("speech-thinker", 2, updated=1, replicas=3)[1]})),
                     prior=ready, now=T1)
    assert [(e.type, e.reason) for e in transition_events(ready, rolling)] == [("Normal", "RollingOut")]


def test_progress_alone_is_not_decisive():
    one = status(Observed(all_ready(**dict([dep("speech-talker", 2, ready=0)]))))
    two = status(Observed(all_ready(**dict([dep("speech-talker", 2, ready=1)]))), prior=one, now=T1)
    assert one != two and decisive(one) == decisive(two)  # counters and message only
    ready = status(Observed(all_ready()), prior=two, now=T1)
    assert decisive(ready) != decisive(two)
    assert decisive(status(Observed(all_ready()), prior=ready, generation=2, now=T1)) != decisive(ready)


def test_a_pass_that_changed_children_is_not_ready_yet():
    st = status(Observed(all_ready()))
    changed = compute_status(name="speech", namespace="default", generation=2, doc=speech(), problems=[],
                             observed=Observed(all_ready()), prior=st, now=T1,
                             applied=["Deployment/speech-thinker"])
    ready = cond(changed, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RollingOut")
    assert "Deployment/speech-thinker" in ready["message"]
    assert changed["observedGeneration"] == 2


def crashing_pod(stage, message):
    p = pod(stage)
    p["status"]["containerStatuses"] = [{
        "name": "stage", "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
    }]
    return p


def test_a_crashing_stage_is_named_with_the_reason_from_its_termination_message():
    log_tail = ("INFO loading engine\nstage talker failed to start: the model /models/nope does not exist\n"
                "ERROR omnifleet.pod: stage worker exit codes: [1]\n")
    observed = Observed(deployments=all_ready(**dict([dep("speech-talker", 2, ready=1)])),
                        pods=[crashing_pod("talker", log_tail), pod("thinker")])
    st = status(observed)
    ready = cond(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ContainerFailing")
    assert ready["message"] == ("stage talker: pod talker-x: CrashLoopBackOff: exited 1: "
                                "stage talker failed to start: the model /models/nope does not exist")
    assert transition_events(None, st)[0].type == "Warning"


def test_a_pod_that_restarted_once_and_runs_is_not_failing():
    p = crashing_pod("talker", "boom")
    p["status"]["containerStatuses"][0]["state"] = {"running": {"startedAt": T0}}
    st = status(Observed(deployments=all_ready(), pods=[p]))
    assert cond(st, "Ready")["status"] == "True"


# -- registration: a stage pod is ready only while registered with the master --

def loaded_pod(stage, ready):
    """A stage pod whose engines loaded (its startup probe passed); ready = registered with the master."""
    p = pod(stage)
    p["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    p["status"]["containerStatuses"] = [{"name": "stage", "started": True, "restartCount": 0,
                                         "state": {"running": {}}, "lastState": {}}]
    return p


def loading_pod(stage):
    p = loaded_pod(stage, ready=False)
    p["status"]["containerStatuses"][0]["started"] = False
    return p


def refused_report(stage="thinker", age=2.0, reason="config hash mismatch for stage 'thinker': ..."):
    return {"ready": False, "missing_stages": [stage], "stages": {
        stage: {"registered": 0, "routable": 0, "lastRefusal": {"reason": reason, "secondsAgo": age}}}}


def test_registered_replicas_are_the_ready_pods_and_ready_needs_all_of_them():
    st = status(Observed(all_ready(**dict([dep("speech-thinker", 2, ready=1)]))))
    thinker = next(s for s in st["stages"] if s["name"] == "thinker")
    assert (thinker["readyReplicas"], thinker["registeredReplicas"], thinker["desiredReplicas"]) == (1, 1, 2)
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ("False", "WaitingForReady")
    assert "thinker (1/2 ready)" in cond(st, "Ready")["message"]


def test_the_master_is_asked_only_when_a_loaded_pod_is_not_registered():
    doc = speech()
    unready = all_ready(**dict([dep("speech-thinker", 2, ready=1)]))
    # loaded and registered, or still loading: the Deployments say all there is
    assert not wants_master_report(doc, Observed(all_ready(), pods=[loaded_pod("thinker", True)]))
    assert not wants_master_report(doc, Observed(unready, pods=[loaded_pod("thinker", True), loading_pod("thinker")]))
    # loaded, not registered: only the master knows why
    assert wants_master_report(doc, Observed(unready, pods=[loaded_pod("thinker", True), loaded_pod("thinker", False)]))
    # no ready master: nothing to ask
    no_master = dict(unready, **dict([dep("speech-master", 1, ready=0)]))
    assert not wants_master_report(doc, Observed(no_master, pods=[loaded_pod("thinker", False)]))


def test_a_refused_stage_is_a_condition_naming_it_and_the_reason():
    waiting = Observed(all_ready(**dict([dep("speech-thinker", 2, ready=1)])), pods=[loaded_pod("thinker", False)])
    st = status(Observed(waiting.deployments, waiting.pods, master=refused_report()))
    ready = cond(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RegistrationRefused")
    assert ready["message"] == ("the master refuses replicas of stage thinker: "
                                "config hash mismatch for stage 'thinker': ...")
    assert [(e.type, e.reason) for e in transition_events(status(Observed(all_ready())), st)] == [
        ("Warning", "RegistrationRefused")]
    # The age of the refusal moves with every read; the status does not (an idle resync writes nothing).
    again = status(Observed(waiting.deployments, waiting.pods, master=refused_report(age=9.5)), prior=st, now=T1)
    assert again == st
    # A refusal older than a replica's retry is history: the stage is just waiting.
    stale = status(Observed(waiting.deployments, waiting.pods, master=refused_report(age=600)))
    assert cond(stale, "Ready")["reason"] == "WaitingForReady"


@pytest.mark.parametrize("report", [
    None, {}, [], "x", {"stages": []}, {"stages": {"a": "x"}}, {"stages": {"a": {"lastRefusal": "x"}}},
    {"stages": {"a": {"lastRefusal": {"reason": 3, "secondsAgo": 1}}}},
    {"stages": {"a": {"lastRefusal": {"reason": "r", "secondsAgo": "1"}}}},
    {"stages": {"a": {"lastRefusal": {"reason": "r", "secondsAgo": True}}}},
    {"stages": {"a": {"lastRefusal": {"reason": "r", "secondsAgo": -1}}}},
])
def test_a_malformed_master_report_is_no_refusal(report):
    assert refusals(report) == []


def test_a_long_refusal_reason_is_cut():
    (line,) = refusals(refused_report(reason="x" * 5000))
    assert line == "stage thinker: " + "x" * 300


# -- a rollout: the stage's pods per revision --

def revision_pod(stage, rev, ready, n):
    p = loaded_pod(stage, ready)
    p["metadata"]["name"] = f"{stage}-{rev}-{n}"
    p["metadata"]["annotations"] = {"omnifleet.dev/template-hash": rev}
    return p


def test_a_rolling_stage_lists_its_pods_per_revision_the_current_one_last():
    deps = all_ready()
    deps["speech-thinker"]["metadata"]["annotations"] = {"omnifleet.dev/template-hash": "new"}
    deps["speech-thinker"]["status"].update(replicas=3, updatedReplicas=1, readyReplicas=2)
    pods = [revision_pod("thinker", "old", True, 1), revision_pod("thinker", "old", True, 2),
            revision_pod("thinker", "new", False, 1)]
    st = status(Observed(deployments=deps, pods=pods))
    thinker = next(s for s in st["stages"] if s["name"] == "thinker")
    assert thinker["revisions"] == [{"revision": "old", "pods": 2, "readyPods": 2, "current": False},
                                    {"revision": "new", "pods": 1, "readyPods": 0, "current": True}]
    assert "revisions" not in next(s for s in st["stages"] if s["name"] == "talker")
    assert st["phase"] == "Progressing" and "thinker (1/2 updated)" in st["message"]
    # The rollout done: one revision, no list.
    deps["speech-thinker"]["status"].update(replicas=2, updatedReplicas=2, readyReplicas=2)
    done = status(Observed(deployments=deps, pods=[revision_pod("thinker", "new", True, n) for n in (1, 2)]))
    assert all("revisions" not in s for s in done["stages"]) and done["phase"] == "Ready"
