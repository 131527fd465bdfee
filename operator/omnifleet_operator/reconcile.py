"""One reconcile pass of one pipeline: parse, render, apply the differences,
delete what is no longer wanted, compute status, write it only if it changed.

I/O goes through `Api` (lightkube); the rest is pure and lives in `render`,
`drift` and `status`.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import ConfigMap, Service, ServiceAccount
from lightkube.resources.core_v1 import Event as EventResource
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType

from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import OmniPipeline
from omnifleet_runtime.validate import Problem

from . import render
from .checks import check_document
from .drift import is_subset
from .status import Event, Observed, compute_status, decisive, transition_events

log = logging.getLogger("omnifleet.reconcile")
Obj = dict[str, Any]

OmniPipelineResource = create_namespaced_resource(C.GROUP, C.VERSION, C.KIND, C.PLURAL)

# Every kind the operator renders: (apiVersion, kind) -> lightkube resource.
CHILD_KINDS = {
    ("v1", "ServiceAccount"): ServiceAccount,
    ("v1", "ConfigMap"): ConfigMap,
    ("v1", "Service"): Service,
    ("apps/v1", "Deployment"): Deployment,
    ("policy/v1", "PodDisruptionBudget"): PodDisruptionBudget,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): HorizontalPodAutoscaler,
    ("networking.k8s.io/v1", "NetworkPolicy"): NetworkPolicy,
}


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class Children:
    """The live children of one pipeline, as the watch caches hold them."""

    objects: list[Obj] = field(default_factory=list)
    pods: list[Obj] = field(default_factory=list)

    def find(self, api_version: str, kind: str, name: str) -> Obj | None:
        for o in self.objects:
            if o.get("kind") == kind and o.get("apiVersion") == api_version and o["metadata"]["name"] == name:
                return o
        return None


EVENT_SOURCE = "omnifleet-operator"
EVENT_MESSAGE_MAX = 1024


def event_object(body: Obj, event: Event, now: str, instance: str = "") -> Obj:
    """A core/v1 Event about a pipeline (what `kubectl describe omnip` lists)."""
    meta = body["metadata"]
    namespace = meta.get("namespace") or "default"
    message = event.message
    if len(message) > EVENT_MESSAGE_MAX:
        message = message[:EVENT_MESSAGE_MAX - 3] + "..."
    ref = {"apiVersion": body.get("apiVersion") or C.API_VERSION, "kind": body.get("kind") or C.KIND,
           "name": meta["name"], "namespace": namespace, "uid": meta.get("uid")}
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
        "involvedObject": {k: v for k, v in ref.items() if v},
        "type": event.type, "reason": event.reason, "message": message,
        "source": {"component": EVENT_SOURCE},
        "reportingComponent": EVENT_SOURCE, "reportingInstance": instance,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


def parse(body: Obj) -> tuple[OmniPipeline | None, list[Problem]]:
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "spec")}
    doc["metadata"] = {"name": body["metadata"]["name"], "namespace": body["metadata"].get("namespace")}
    return check_document(doc)


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def object_key(obj: Obj) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace") or "", meta["name"])


def _resource_version(obj: Obj) -> int | None:
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class AppliedCache:
    """What this operator last applied to each child and the resourceVersion that came back.

    The watch shows a write a moment later; a pass in between would see the
    older object and send the same apply again. Such an object is *pending*:
    not applied again, and not yet taken as observed by status.
    """

    entries: dict[tuple[str, str, str, str], tuple[str, int]] = field(default_factory=dict)

    def record(self, obj: Obj, resource_version: int | None) -> None:
        if resource_version is not None:
            self.entries[object_key(obj)] = (render.stable_hash(obj), resource_version)

    def forget(self, key: tuple[str, str, str, str]) -> None:
        self.entries.pop(key, None)

    def pending(self, obj: Obj, live: Obj | None) -> bool:
        entry = self.entries.get(object_key(obj))
        if entry is None or entry[0] != render.stable_hash(obj):
            return False
        if live is None:
            return True  # created here, its ADDED event not seen yet (a deletion forgets the entry)
        rv = _resource_version(live)
        return rv is not None and rv < entry[1]


@dataclass
class Plan:
    apply: list[Obj]
    delete: list[Obj]
    pending: list[Obj] = field(default_factory=list)


def plan(desired: list[Obj], children: Children, uid: str, cache: AppliedCache | None = None) -> Plan:
    """What to apply (missing or drifted), what is pending, what to delete (ours, no longer desired)."""
    wanted = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in desired}
    out = Plan([], [])
    for o in desired:
        live = children.find(o["apiVersion"], o["kind"], o["metadata"]["name"])
        if cache is not None and cache.pending(o, live):
            out.pending.append(o)
        elif not is_subset(o, live):
            out.apply.append(o)
    out.delete = [o for o in children.objects
                  if (o.get("apiVersion"), o.get("kind"), o["metadata"]["name"]) not in wanted and _owned_by(o, uid)]
    return out


class Api:
    """The few writes the operator makes, through lightkube's async client."""

    def __init__(self, client: AsyncClient | None = None):
        self.client = client or AsyncClient(field_manager=C.FIELD_MANAGER)

    async def apply(self, obj: Obj) -> int | None:
        """Server-side apply; the resourceVersion of the result."""
        res = CHILD_KINDS[(obj["apiVersion"], obj["kind"])]
        out = await self.client.patch(res, obj["metadata"]["name"], obj, namespace=obj["metadata"]["namespace"],
                                      patch_type=PatchType.APPLY, field_manager=C.FIELD_MANAGER, force=True)
        try:
            return int(out.metadata.resourceVersion)
        except (AttributeError, TypeError, ValueError):
            return None

    async def delete(self, obj: Obj) -> None:
        res = CHILD_KINDS[(obj["apiVersion"], obj["kind"])]
        try:
            await self.client.delete(res, obj["metadata"]["name"], namespace=obj["metadata"]["namespace"])
        except ApiError as err:
            if err.status.code != 404:
                raise

    async def post_event(self, event: Obj) -> None:
        await self.client.create(EventResource.from_dict(event), namespace=event["metadata"]["namespace"])

    async def write_status(self, namespace: str, name: str, status: Obj) -> None:
        await self.client.patch(OmniPipelineResource.Status, name, {"status": status}, namespace=namespace,
                                patch_type=PatchType.MERGE)


def _api_error_text(err: Exception) -> str:
    if isinstance(err, ApiError):
        return f"{err.status.code} {err.status.reason}: {err.status.message}"
    return f"{type(err).__name__}: {err}"


@dataclass
class Outcome:
    applied: int = 0
    deleted: int = 0
    status_written: bool = False
    status_held: bool = False  # a progress-only change not written yet (hold_progress)
    status: Obj = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


async def reconcile(api: Api, body: Obj, children: Children, registered: dict[str, int] | None = None,
                    last_status: Obj | None = None, cache: AppliedCache | None = None,
                    hold_progress: bool = False) -> Outcome:
    """One pass. Writes only what differs; never raises for a bad spec.

    `last_status` is the status this operator last wrote for this object: a
    pass that runs before that write comes back through the watch compares
    with it rather than with the older status in `body`, so it neither writes
    the same status twice nor repeats its events. With `hold_progress`, a
    change of progress only (see `status.decisive`) is not written; the
    caller runs the pass again when it wants it written.
    """
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace", "default"), meta["uid"]
    generation = int(meta.get("generation") or 0)
    outcome = Outcome()
    doc, problems = parse(body)
    apply_error = None
    applied: list[str] = []
    if doc is not None:
        # The CR's namespace is where children go, whatever the spec document said.
        todo = plan(render.desired(doc, owner_uid=uid), children, uid, cache)
        # Status must not call pending objects observed: what `children` shows of them is older.
        applied += [f"{o['kind']}/{o['metadata']['name']}" for o in todo.pending]
        try:
            for obj in todo.apply:
                rv = await api.apply(obj)
                if cache is not None:
                    cache.record(obj, rv)
                applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
                outcome.applied += 1
            for obj in todo.delete:
                await api.delete(obj)
                outcome.deleted += 1
        except Exception as err:  # reported in status; the next pass retries
            apply_error = _api_error_text(err)
            log.warning("%s/%s: apply failed: %s", namespace, name, apply_error)

    deployments = {o["metadata"]["name"]: o for o in children.objects if o.get("kind") == "Deployment"}
    prior = last_status if last_status is not None else (body.get("status") or {})
    status = compute_status(
        name=name, namespace=namespace, generation=generation, doc=doc, problems=problems,
        observed=Observed(deployments=deployments, pods=children.pods, registered=registered),
        prior=prior, now=now_iso(), apply_error=apply_error, applied=applied,
    )
    outcome.status = status
    if status != prior and hold_progress and decisive(status) == decisive(prior):
        outcome.status_held = True
    elif status != prior:
        await api.write_status(namespace, name, status)
        outcome.status_written = True
        # Events only after the status they describe is stored.
        outcome.events = transition_events(prior, status)
    return outcome
