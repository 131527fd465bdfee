"""Status of a pipeline, computed by a pure function from what was observed.

Readiness is decided by a chain of checks, each `(input) -> Verdict | None`,
first failure wins (as cert-manager does). Conditions keep their
`lastTransitionTime` unless their status flips, so an unchanged world yields
an identical status and the reconciler writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import OmniPipeline
from omnifleet_runtime.validate import Problem

from . import names

Obj = dict[str, Any]

READY, PROGRESSING, DEGRADED, RECONCILING, STALLED = "Ready", "Progressing", "Degraded", "Reconciling", "Stalled"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, RECONCILING, STALLED)

# Reasons
INVALID_SPEC = "InvalidSpec"
APPLY_FAILED = "ApplyFailed"
CREATING = "Creating"
ROLLING_OUT = "RollingOut"
CAPACITY_PENDING = "CapacityPending"
WAITING_FOR_READY = "WaitingForReady"
SCALED_TO_ZERO = "ScaledToZero"
REPLICA_FAILURE = "ReplicaFailure"
PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
STAGE_UNAVAILABLE = "StageUnavailable"
CONTAINER_FAILING = "ContainerFailing"
ALL_READY = "AllStagesReady"
NAME_CONFLICT = "NameConflict"
REGISTRATION_REFUSED = "RegistrationRefused"

WARNING_REASONS = {INVALID_SPEC, APPLY_FAILED, NAME_CONFLICT, CAPACITY_PENDING, REPLICA_FAILURE, PROGRESS_DEADLINE,
                   STAGE_UNAVAILABLE, CONTAINER_FAILING, REGISTRATION_REFUSED}
# A refused replica asks again every few seconds: a refusal older than this is history, not why a stage waits.
REFUSAL_FRESH_S = 30.0
# Container states that will not fix themselves without a change (or keep failing meanwhile).
FAILING_WAITING = {"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                   "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
STALLED_REASONS = {INVALID_SPEC, REPLICA_FAILURE, PROGRESS_DEADLINE, NAME_CONFLICT}
# The usual steps of a pipeline coming up: shown in status, not worth an Event
# each (a mass create would post one per pipeline per step).
QUIET_REASONS = {CREATING, WAITING_FOR_READY}


@dataclass(frozen=True)
class Observed:
    """What the reconciler saw of a pipeline's children."""

    deployments: dict[str, Obj] = field(default_factory=dict)  # by name
    pods: list[Obj] = field(default_factory=list)  # this pipeline's pods
    # What the master's /ready said (see wants_master_report), or None: not read.
    master: Obj | None = None


@dataclass(frozen=True)
class Verdict:
    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def _cond(dep: Obj, ctype: str) -> Obj | None:
    for c in (dep.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def _pods_of(pods: list[Obj], view: "StageView") -> list[Obj]:
    out = []
    for pod in pods:
        lbls = pod.get("metadata", {}).get("labels") or {}
        if view.name == "master":
            if lbls.get(C.LABEL_OF_COMPONENT) == C.COMPONENT_MASTER:
                out.append(pod)
        elif lbls.get(C.LABEL_STAGE) == view.name:
            out.append(pod)
    return out


def _pod_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def revisions(pods: list[Obj], view: "StageView") -> list[Obj]:
    """A stage's pods per revision (their template hash) while more than one is present (a rollout), the
    current one last; empty otherwise."""
    current = ((view.dep or {}).get("metadata", {}).get("annotations") or {}).get(C.ANNOTATION_TEMPLATE_HASH)
    counts: dict[str, list[int]] = {}
    for pod in _pods_of(pods, view):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        rev = (pod["metadata"].get("annotations") or {}).get(C.ANNOTATION_TEMPLATE_HASH) or "unknown"
        entry = counts.setdefault(rev, [0, 0])
        entry[0] += 1
        entry[1] += _pod_ready(pod)
    if len(counts) < 2:
        return []
    return [{"revision": rev, "pods": n, "readyPods": ready, "current": rev == current}
            for rev, (n, ready) in sorted(counts.items(), key=lambda kv: (kv[0] == current, kv[0]))]


def _last_line(text: str) -> str:
    """The line of a log tail that says why: the last `failed to start` line (a stage names its
    reason there; lines after it report exit codes), else the last line."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    why = [line for line in lines if "failed to start" in line]
    return (why or lines or [""])[-1][:300]


def container_failure(pod: Obj) -> str | None:
    """Why a pod's container keeps failing, from its state and its termination message; None if it is not."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") not in FAILING_WAITING:
            continue
        if last:
            why = _last_line(last.get("message", "")) or last.get("reason") or "no message"
            return f"{waiting['reason']}: exited {last.get('exitCode')}: {why}"
        return f"{waiting['reason']}: {_last_line(waiting.get('message', '')) or 'no message'}"
    return None


def _started_unready(pod: Obj) -> bool:
    """Every engine of the pod loaded (its startup probe passed), yet the pod is not ready: a stage
    pod is ready only while the master routes to it, so the master did not take it."""
    st = pod.get("status") or {}
    statuses = st.get("containerStatuses") or []
    return bool(statuses) and all(cs.get("started") is True for cs in statuses) and not _pod_ready(pod)


def unschedulable_condition(pod: Obj) -> Obj | None:
    """The pod's PodScheduled condition when the scheduler found no node for it."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c
    return None


def _unschedulable(pods: list[Obj], view: "StageView") -> list[Obj]:
    return [c for pod in _pods_of(pods, view) if (c := unschedulable_condition(pod)) is not None]


@dataclass(frozen=True)
class StageView:
    """One pod group (a Deployment) as observed."""

    name: str  # host stage, or "master"
    deployment_name: str
    desired: int
    dep: Obj | None
    idle_at_zero: bool = False  # autoscaled with minReplicas 0: at zero it serves (requests wait for a replica)

    @property
    def status(self) -> Obj:
        return (self.dep or {}).get("status") or {}

    @property
    def ready(self) -> int:
        return int(self.status.get("readyReplicas") or 0)

    @property
    def updated(self) -> int:
        return int(self.status.get("updatedReplicas") or 0)

    @property
    def replicas(self) -> int:
        return int(self.status.get("replicas") or 0)

    @property
    def is_ready(self) -> bool:
        if self.dep is not None and self.desired == 0 and self.idle_at_zero:
            return self.replicas == 0  # scaled to zero and nothing left terminating
        return (self.dep is not None and self.desired > 0 and self.ready >= self.desired
                and self.updated >= self.desired and self.replicas == self.updated
                and self.status.get("observedGeneration", 0) >= self.dep["metadata"].get("generation", 0))


def stage_views(doc: OmniPipeline, observed: Observed) -> list[StageView]:
    p = doc.metadata.name
    views = [StageView("master", names.master_name(p), doc.spec.master.replicas,
                       observed.deployments.get(names.master_name(p)))]
    for host in doc.spec.hosts():
        dname = names.stage_name(p, host.name)
        dep = observed.deployments.get(dname)
        if host.autoscaling is not None:
            # The autoscaler owns the count: read it from the live Deployment.
            live = (dep or {}).get("spec", {}).get("replicas")
            desired = host.autoscaling.min_replicas if live is None else int(live)
        else:
            desired = 1 if host.replicas is None else host.replicas
        views.append(StageView(host.name, dname, desired, dep,
                               idle_at_zero=host.autoscaling is not None and host.autoscaling.min_replicas == 0))
    return views


def wants_master_report(doc: OmniPipeline, observed: Observed) -> bool:
    """Whether only the master can say why the pipeline is not Ready: its Deployment is ready, and
    some stage pod loaded its engines but is not registered. The operator reads the master's
    /ready only then, so a healthy or still-loading pipeline costs it nothing."""
    views = stage_views(doc, observed)
    if not views[0].is_ready:
        return False
    return any(v.dep is not None and v.ready < v.desired
               and any(_started_unready(p) for p in _pods_of(observed.pods, v)) for v in views[1:])


def refusals(report: Obj | None) -> list[str]:
    """`stage S: REASON` for each stage whose registration the master refused lately, from its /ready
    body (which comes from a pod: anything malformed counts as no refusal)."""
    out = []
    stages = (report or {}).get("stages") if isinstance(report, dict) else None
    if not isinstance(stages, dict):
        return out
    for name in sorted(stages, key=str):
        last = stages[name].get("lastRefusal") if isinstance(stages[name], dict) else None
        if not isinstance(last, dict) or not isinstance(last.get("reason"), str):
            continue
        age = last.get("secondsAgo")
        if isinstance(age, (int, float)) and not isinstance(age, bool) and 0 <= age <= REFUSAL_FRESH_S:
            out.append(f"stage {str(name)[:63]}: {last['reason'][:300]}")
    return out


# -- the check chain ----------------------------------------------------------

def check_failures(views: list[StageView], observed: Observed) -> Verdict | None:
    for v in views:
        if v.dep is None:
            continue
        failure = _cond(v.dep, "ReplicaFailure")
        if failure and failure.get("status") == "True":
            return Verdict(REPLICA_FAILURE, f"{v.name}: {failure.get('message') or failure.get('reason')}")
        progressing = _cond(v.dep, "Progressing")
        if progressing and progressing.get("status") == "False" and progressing.get("reason") == PROGRESS_DEADLINE:
            return Verdict(PROGRESS_DEADLINE, f"{v.name}: rollout exceeded its progress deadline")
    return None


def check_containers(views: list[StageView], observed: Observed) -> Verdict | None:
    """A container that crashes or cannot start, with the reason it gave (its termination message)."""
    failing = []
    for v in views:
        for pod in _pods_of(observed.pods, v):
            why = container_failure(pod)
            if why:
                failing.append(f"{'' if v.name == 'master' else 'stage '}{v.name}: pod {pod['metadata']['name']}: {why}")
                break
    if failing:
        return Verdict(CONTAINER_FAILING, "; ".join(failing))
    return None


def check_capacity(views: list[StageView], observed: Observed) -> Verdict | None:
    pending = []
    for v in views:
        stuck = _unschedulable(observed.pods, v)
        if stuck:
            pending.append(f"stage {v.name}: {len(stuck)} pod(s) unschedulable: {stuck[0].get('message', '')}".strip())
    if pending:
        return Verdict(CAPACITY_PENDING, "; ".join(pending))
    return None


def check_registration(views: list[StageView], observed: Observed) -> Verdict | None:
    """The master refuses a stage's replicas (a config-hash mismatch, an identity it does not take)."""
    refused = refusals(observed.master)
    if refused:
        return Verdict(REGISTRATION_REFUSED, "the master refuses replicas of " + "; ".join(refused))
    return None


def check_rollout(views: list[StageView], observed: Observed) -> Verdict | None:
    missing = [v.name for v in views if v.dep is None]
    if missing:
        return Verdict(CREATING, "creating " + ", ".join(missing))
    zero = [v.name for v in views if v.desired == 0 and not v.idle_at_zero]
    if zero:
        return Verdict(SCALED_TO_ZERO, "scaled to zero: " + ", ".join(zero))
    rolling = [f"{v.name} ({v.updated}/{v.desired} updated)" for v in views
               if v.updated < v.desired or v.replicas > v.updated
               or v.status.get("observedGeneration", 0) < v.dep["metadata"].get("generation", 0)]
    if rolling:
        return Verdict(ROLLING_OUT, "rolling out " + ", ".join(rolling))
    waiting = [f"{v.name} ({v.ready}/{v.desired} ready)" for v in views if not v.is_ready]
    if waiting:
        return Verdict(WAITING_FOR_READY, "waiting for " + ", ".join(waiting))
    return None


CHECKS = (check_failures, check_containers, check_capacity, check_registration, check_rollout)


# -- status -------------------------------------------------------------------

def _conditions(values: dict[str, tuple[str, str, str]], prior: list[Obj], generation: int, now: str) -> list[Obj]:
    before = {c.get("type"): c for c in prior or []}
    out = []
    for ctype in CONDITION_TYPES:
        status, reason, message = values[ctype]
        old = before.get(ctype)
        since = old.get("lastTransitionTime") if old and old.get("status") == status and old.get("lastTransitionTime") else now
        out.append({"type": ctype, "status": status, "reason": reason, "message": message,
                    "observedGeneration": generation, "lastTransitionTime": since})
    return out


def _prior_condition(prior: Obj, ctype: str) -> Obj:
    for c in (prior or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return {}


def compute_status(*, name: str, namespace: str, generation: int, doc: OmniPipeline | None,
                   problems: list[Problem], observed: Observed, prior: Obj | None, now: str,
                   apply_error: str | None = None, applied: list[str] = (), conflicts: list[str] = ()) -> Obj:
    """The whole `.status` of a pipeline. Pure: same inputs, same output.

    `applied` names the children this pass just changed: `observed` predates
    those writes, so it cannot show the pipeline Ready yet. `conflicts` names
    objects that hold a child's name and are not this pipeline's (nothing was
    applied: the operator never takes them over).
    """
    prior = prior or {}
    if problems or doc is None:
        shown = "; ".join(map(str, problems[:3])) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        message = f"invalid spec: {shown}"
        values = {
            READY: ("False", INVALID_SPEC, message),
            PROGRESSING: ("False", INVALID_SPEC, message),
            DEGRADED: ("False", INVALID_SPEC, ""),
            RECONCILING: ("False", INVALID_SPEC, ""),
            STALLED: ("True", INVALID_SPEC, message),
        }
        out = {"observedGeneration": generation, "phase": "Invalid", "message": message,
               "conditions": _conditions(values, prior.get("conditions"), generation, now)}
        # Keep what was last seen of the stages: nothing was changed on their side.
        for key in ("stages", "readyStages", "endpoint"):
            if key in prior:
                out[key] = prior[key]
        return out

    views = stage_views(doc, observed)
    by_host = {v.name: v for v in views}
    verdict = None
    if conflicts:
        verdict = Verdict(NAME_CONFLICT, "not controlled by this pipeline, left untouched (delete or rename them): "
                          + ", ".join(conflicts))
    elif apply_error:
        verdict = Verdict(APPLY_FAILED, apply_error)
    for check in CHECKS:
        verdict = verdict or check(views, observed)
    if verdict is None and applied:
        verdict = Verdict(ROLLING_OUT, "applied " + ", ".join(applied))

    stages = []
    ready_count = 0
    for s in doc.spec.stages:
        v = by_host[s.colocate_with or s.name]
        entry = {"name": s.name, "replicas": v.replicas, "readyReplicas": v.ready,
                 "updatedReplicas": v.updated, "desiredReplicas": v.desired}
        if s.colocate_with:
            entry["host"] = s.colocate_with
        # A stage pod is ready only while each of its stages is registered with the master (its /readyz).
        entry["registeredReplicas"] = v.ready
        if revs := revisions(observed.pods, v):
            entry["revisions"] = revs
        stages.append(entry)
        ready_count += v.is_ready

    was_ready = _prior_condition(prior, READY).get("status") == "True"
    was_unavailable = _prior_condition(prior, DEGRADED).get("reason") == STAGE_UNAVAILABLE
    lost = [v.name for v in views if v.dep is not None and v.desired > 0 and v.ready == 0]
    degraded: Verdict | None = None
    if verdict and verdict.reason in (REPLICA_FAILURE, PROGRESS_DEADLINE):
        degraded = verdict
    elif lost and (was_ready or was_unavailable):
        degraded = Verdict(STAGE_UNAVAILABLE, "no ready replica: " + ", ".join(lost))

    if verdict is None:
        msg = f"all {len(doc.spec.stages)} stages ready"
        if idle := [v.name for v in views if v.idle_at_zero and v.desired == 0]:
            msg += f" ({', '.join(idle)} scaled to zero: requests wait for a replica)"
        values = {
            READY: ("True", ALL_READY, msg),
            PROGRESSING: ("False", "Complete", ""),
            DEGRADED: ("False", "AsExpected", ""),
            RECONCILING: ("False", "Complete", ""),
            STALLED: ("False", "AsExpected", ""),
        }
        phase, message = "Ready", ""
    else:
        stalled = verdict.reason in STALLED_REASONS
        values = {
            READY: ("False", verdict.reason, verdict.message),
            PROGRESSING: ("False" if stalled else "True", verdict.reason, verdict.message),
            DEGRADED: ("True", degraded.reason, degraded.message) if degraded else ("False", "AsExpected", ""),
            RECONCILING: ("False" if stalled else "True", verdict.reason, verdict.message if not stalled else ""),
            STALLED: ("True", verdict.reason, verdict.message) if stalled else ("False", "AsExpected", ""),
        }
        phase = ("Degraded" if degraded else "Pending" if verdict.reason == CAPACITY_PENDING else "Progressing")
        message = verdict.message

    return {
        "observedGeneration": generation,
        "phase": phase,
        "message": message,
        "readyStages": f"{ready_count}/{len(doc.spec.stages)}",
        "endpoint": names.master_endpoint(name, namespace, doc.spec.master.api_port),
        "stages": stages,
        "conditions": _conditions(values, prior.get("conditions"), generation, now),
    }


def transition_events(old: Obj | None, new: Obj) -> list[Event]:
    """Events for a change of the Ready condition (status or reason)."""
    before = _prior_condition(old or {}, READY)
    after = _prior_condition(new, READY)
    if (before.get("status"), before.get("reason")) == (after.get("status"), after.get("reason")):
        return []
    reason = after.get("reason", "")
    if after.get("status") == "True":
        return [Event("Normal", "Ready", after.get("message", ""))]
    if reason in QUIET_REASONS and before.get("status") != "True":
        return []
    if reason == ROLLING_OUT and before.get("reason", CREATING) == CREATING:
        # A new pipeline's Deployments coming up (its first status may be this one, see coming_up): a step
        # of coming up, not a rollout.
        return []
    kind = "Warning" if reason in WARNING_REASONS else "Normal"
    return [Event(kind, reason, after.get("message", ""))]


def coming_up(status: Obj) -> bool:
    """A status that says only that the pipeline is on its way: phase Progressing, no warning reason. In a
    mass create its write may wait for the pipelines still waiting for their children (see handlers)."""
    return status.get("phase") == "Progressing" and _prior_condition(status, READY).get("reason") not in WARNING_REASONS


def decisive(status: Obj) -> tuple:
    """What a status change is written for at once: generation, phase, and each
    condition's status and reason. The rest (messages, per-stage counters) is
    progress, which may wait a few seconds to be written with the next change."""
    return (status.get("observedGeneration"), status.get("phase"),
            tuple((c.get("type"), c.get("status"), c.get("reason")) for c in status.get("conditions") or ()))
