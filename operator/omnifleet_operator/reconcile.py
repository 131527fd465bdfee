"""One reconcile pass of one pipeline: parse, render, apply the differences,
delete what is no longer wanted, compute status, write it only if it changed.

I/O goes through `Api` (lightkube); the rest is pure and lives in `render`,
`drift` and `status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import ConfigMap, Secret, Service, ServiceAccount
from lightkube.resources.core_v1 import Event as EventResource
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType

from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import OmniPipeline
from omnifleet_runtime.validate import Problem

from . import metrics, names, render
from .checks import Policy, check_document
from .curvekeys import pipeline_keys
from .drift import is_subset
from .status import (Event, Observed, coming_up, compute_status, decisive, transition_events,
                     unschedulable_condition, wants_master_report)

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
    ("v1", "Secret"): Secret,  # the pipeline's keys: made here, never rendered with data
    # The Prometheus Operator's; only applied when a pipeline asks for it (spec.monitoring).
    ("monitoring.coreos.com/v1", "PodMonitor"): create_namespaced_resource(
        "monitoring.coreos.com", "v1", "PodMonitor", "podmonitors"),
}


# A create-only apply: server-side apply carrying this resourceVersion creates an absent object and is
# refused (409) for an existing one, whoever holds it: a child's name is claimed in the same request that
# makes it, with no read before. etcd's first write is revision 2, so no stored object has this version.
CREATE_ONLY_RV = "1"
# A new pipeline's children are made in two waves: its workloads (whose pods take nodes and GPUs) only
# after every other name was free.
WORKLOAD_KINDS = frozenset({"Deployment", "HorizontalPodAutoscaler"})


class Exists(Exception):
    """A create-only apply found an object of that name."""


# The master's /ready is read through the API server only while a stage's pods are loaded yet
# unregistered, at most this often per pipeline; between reads the last answer stands.
MASTER_READ_SECONDS = 15.0
MASTER_READ_TIMEOUT_S = 3.0
MASTER_READ_MAX_BYTES = 64 * 1024


class MasterReads:
    """The last /ready answer of each pipeline's master (by pipeline uid), read at a bounded cadence."""

    def __init__(self, every_s: float = MASTER_READ_SECONDS, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._last: dict[str, tuple[float, Obj | None]] = {}
        self.reads = 0

    async def report(self, api: "Api", uid: str, namespace: str, name: str) -> Obj | None:
        now = self.clock()
        hit = self._last.get(uid)
        if hit is not None and now - hit[0] < self.every_s:
            return hit[1]
        self.reads += 1
        try:
            report = await api.master_ready(namespace, names.master_name(name))
        except Exception as err:  # no answer says nothing: status stays as the Deployments have it
            log.info("%s/%s: reading the master's /ready failed: %s", namespace, name, _api_error_text(err))
            report = None
        self._last[uid] = (now, report)
        return report

    def forget(self, uid: str) -> None:
        self._last.pop(uid, None)


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


def parse(body: Obj, policy: Policy = Policy()) -> tuple[OmniPipeline | None, list[Problem]]:
    doc = {k: body.get(k) for k in ("apiVersion", "kind", "spec")}
    meta = body["metadata"]
    doc["metadata"] = {"name": meta["name"], "namespace": meta.get("namespace")}
    if meta.get("generation") is not None:
        doc["metadata"]["generation"] = meta["generation"]
    return check_document(doc, policy)


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def controlled_by(obj: Obj, uid: str) -> bool:
    """Whether this pipeline is the object's controller (the only objects it may write)."""
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or [])


def usable_keys(secret: Obj | None) -> bool:
    data = (secret or {}).get("data") or {}
    return all(data.get(k) for k in C.KEY_FILES)


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
    # By pipeline uid: the children whose names others held at its last pass. The next pass reads those
    # names first and makes nothing (not even keys) while any is still held: making and undoing a pass's
    # objects each time would be writes, and watch events that queue the pipeline again.
    conflicts: dict[str, list[Obj]] = field(default_factory=dict)

    def record(self, obj: Obj, resource_version: int | None) -> None:
        if resource_version is not None:
            self.entries[object_key(obj)] = (render.stable_hash(obj), resource_version)

    def forget(self, key: tuple[str, str, str, str]) -> None:
        self.entries.pop(key, None)

    def knows(self, obj: Obj) -> bool:
        """Whether this operator applied an object of obj's kind and name (and saw no deletion of it)."""
        return object_key(obj) in self.entries

    def pending(self, obj: Obj, live: Obj | None) -> bool:
        key = object_key(obj)
        entry = self.entries.get(key)
        if entry is None:
            return False
        rv = _resource_version(live) if live is not None else None
        if rv is not None and rv >= entry[1]:
            del self.entries[key]  # the watch shows the write: nothing left to remember (nor to hash)
            return False
        if entry[0] != render.stable_hash(obj):
            return False
        return live is None or rv is not None  # created here, its ADDED event not seen yet, or an older object


@dataclass
class Plan:
    apply: list[Obj]
    delete: list[Obj]
    pending: list[Obj] = field(default_factory=list)
    create: list[Obj] = field(default_factory=list)  # not in the watch: made create-only (see CREATE_ONLY_RV)


def plan(desired: list[Obj], children: Children, uid: str, cache: AppliedCache | None = None) -> Plan:
    """What to create (missing), to apply (drifted), what is pending, what to delete (ours, no longer desired)."""
    wanted = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in desired}
    out = Plan([], [])
    for o in desired:
        live = children.find(o["apiVersion"], o["kind"], o["metadata"]["name"])
        if cache is not None and cache.pending(o, live):
            out.pending.append(o)
        elif live is None:
            out.create.append(o)
        elif not is_subset(o, live):
            out.apply.append(o)
    # The keys Secret is never rendered (its data is made here) and lives as long as the pipeline.
    out.delete = [o for o in children.objects
                  if (o.get("apiVersion"), o.get("kind"), o["metadata"]["name"]) not in wanted and _owned_by(o, uid)
                  and o.get("kind") != "Secret"]
    return out


def _keys_hash_of(dep: Obj | None) -> str | None:
    return (((dep or {}).get("spec", {}).get("template", {}).get("metadata") or {}).get("annotations") or {}).get(
        C.ANNOTATION_KEYS_HASH)


def _rolled(want: Obj, live: Obj | None) -> bool:
    """Whether a stage Deployment's pods all run the wanted keys (its rollout to them is complete)."""
    if live is None or _keys_hash_of(live) != _keys_hash_of(want):
        return False
    st = live.get("status") or {}
    replicas = int(live.get("spec", {}).get("replicas", 1))
    return (int(st.get("observedGeneration") or 0) >= int(live["metadata"].get("generation") or 0)
            and int(st.get("updatedReplicas") or 0) >= replicas and int(st.get("readyReplicas") or 0) >= replicas
            and int(st.get("replicas") or 0) == int(st.get("updatedReplicas") or 0))


def _loaded(want: Obj, live: Obj | None, pods: list[Obj]) -> bool:
    """Whether a stage Deployment has pods on the wanted keys and every pod of it has loaded its
    engines (started). A pod on new keys cannot register with a master on the old ones, so it is not
    ready (ready means registered) and the rollout goes no further than its surge pod until the master
    moves to the new keys."""
    if live is None or _keys_hash_of(live) != _keys_hash_of(want):
        return False
    st = live.get("status") or {}
    if (int(st.get("observedGeneration") or 0) < int(live["metadata"].get("generation") or 0)
            or int(st.get("updatedReplicas") or 0) < min(1, int(live.get("spec", {}).get("replicas", 1)))):
        return False
    stage = want["spec"]["template"]["metadata"]["labels"].get(C.LABEL_STAGE)
    mine = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(C.LABEL_STAGE) == stage]
    if len(mine) < int(st.get("replicas") or 0):  # a pod the Deployment made is not in the index yet
        return False
    return all((p.get("status") or {}).get("containerStatuses")
               and all(cs.get("started") is True for cs in p["status"]["containerStatuses"]) for p in mine)


def master_keys_hold(wanted: list[Obj], children: Children) -> str | None:
    """The keys hash the master keeps while new keys roll through the stages (None: no hold).

    New stage pods cannot register with a master on the old keys, and old ones
    cannot with a master on the new keys. Stages roll first (maxUnavailable 0:
    the old pods serve with the old master), the master once each stage's new
    pods have loaded their engines, so the pipeline is without replicas only
    for the master's restart, not for a model load. (A new pod is ready only once
    registered, so its rollout waits for the master on the new keys.)
    """
    master = next((o for o in wanted if o["kind"] == "Deployment"
                   and o["spec"]["template"]["metadata"]["labels"].get(C.LABEL_COMPONENT) == C.COMPONENT_MASTER), None)
    if master is None:
        return None
    live = children.find("apps/v1", "Deployment", master["metadata"]["name"])
    if live is None or _keys_hash_of(live) == _keys_hash_of(master):
        return None
    stages = [o for o in wanted if o["kind"] == "Deployment" and o is not master]
    if all(_rolled(o, live) or _loaded(o, live, children.pods)
           for o in stages for live in [children.find("apps/v1", "Deployment", o["metadata"]["name"])]):
        return None
    return _keys_hash_of(live)


NO_ROOM = {"maxSurge": 0, "maxUnavailable": 1}  # one old pod out, one new in


def _template_hash(obj: Obj) -> str | None:
    return ((obj.get("spec", {}).get("template", {}).get("metadata") or {}).get("annotations") or {}).get(
        C.ANNOTATION_TEMPLATE_HASH)


def rollouts_without_room(wanted: list[Obj], children: Children) -> list[str]:
    """Stage Deployments whose rollout has no room for its surge pod (it finds no node): the rollout goes
    on one replica at a time (NO_ROOM) until it is done, then the spec's policy is back.

    Only for a stage of two replicas or more, so none goes to zero; a stage of one waits for room,
    its old pod serving (the status says CapacityPending). Sets the strategy in `wanted`; returns the names
    of those it sets for the first time.
    """
    out = []
    for obj in wanted:
        if obj["kind"] != "Deployment":
            continue
        labels = obj["spec"]["template"]["metadata"].get("labels") or {}
        if labels.get(C.LABEL_COMPONENT) != C.COMPONENT_STAGE:
            continue
        live = children.find("apps/v1", "Deployment", obj["metadata"]["name"])
        strategy = obj["spec"]["strategy"]["rollingUpdate"]
        if live is None or strategy["maxSurge"] == 0 or int(live["spec"].get("replicas") or 0) < 2:
            continue
        current = _template_hash(obj)
        pods = [p for p in children.pods if not p["metadata"].get("deletionTimestamp")
                and (p["metadata"].get("labels") or {}).get(C.LABEL_STAGE) == labels[C.LABEL_STAGE]]
        hashes = [(p["metadata"].get("annotations") or {}).get(C.ANNOTATION_TEMPLATE_HASH) for p in pods]
        if _template_hash(live) != current or all(h == current for h in hashes):
            continue  # not rolling to this template (or just starting to: room is not known yet), or done
        held = (live["spec"].get("strategy") or {}).get("rollingUpdate") == NO_ROOM
        if held or any(unschedulable_condition(p) and h == current for p, h in zip(pods, hashes)):
            obj["spec"]["strategy"]["rollingUpdate"] = dict(NO_ROOM)
            if not held:
                out.append(obj["metadata"]["name"])
    return out


def ref(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def watched_conflicts(wanted: list[Obj], children: Children, uid: str) -> list[str]:
    """Wanted children's names held, in the watch, by objects this pipeline does not control. The watch
    sees only labeled objects: an unlabeled one of such a name is found by the create-only apply."""
    out = []
    for o in wanted:
        live = children.find(o["apiVersion"], o["kind"], o["metadata"]["name"])
        if live is not None and not controlled_by(live, uid):
            out.append(ref(o))
    return out


class Api:
    """The few writes the operator makes, through lightkube's async client. `applies_in_flight`: at most
    that many applies at once, from all passes together (a pass sends its children's applies at once)."""

    def __init__(self, client: AsyncClient | None = None, applies_in_flight: int = 8):
        self.client = client or AsyncClient(field_manager=C.FIELD_MANAGER)
        self.slots = asyncio.Semaphore(applies_in_flight)

    async def apply(self, obj: Obj, create_only: bool = False) -> int | None:
        """Server-side apply; the resourceVersion of the result. `create_only`: raise Exists, writing
        nothing, when an object of that name exists."""
        res = CHILD_KINDS[(obj["apiVersion"], obj["kind"])]
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": CREATE_ONLY_RV}} if create_only else obj
        async with self.slots:
            with _counted(obj["kind"], "apply"):
                try:
                    out = await self.client.patch(res, obj["metadata"]["name"], body,
                                                  namespace=obj["metadata"]["namespace"], patch_type=PatchType.APPLY,
                                                  field_manager=C.FIELD_MANAGER, force=True)
                except ApiError as err:
                    if create_only and err.status.code == 409:
                        raise Exists(ref(obj)) from None
                    raise
        try:
            return int(out.metadata.resourceVersion)
        except (AttributeError, TypeError, ValueError):
            return None

    async def get(self, obj: Obj) -> Obj | None:
        """The live object of obj's kind and name, or None."""
        res = CHILD_KINDS[(obj["apiVersion"], obj["kind"])]
        try:
            out = await self.client.get(res, obj["metadata"]["name"], namespace=obj["metadata"]["namespace"])
        except ApiError as err:
            if err.status.code == 404:
                return None
            raise
        return out.to_dict()

    async def delete(self, obj: Obj) -> None:
        res = CHILD_KINDS[(obj["apiVersion"], obj["kind"])]
        with _counted(obj["kind"], "delete"):
            try:
                await self.client.delete(res, obj["metadata"]["name"], namespace=obj["metadata"]["namespace"])
            except ApiError as err:
                if err.status.code != 404:
                    raise

    async def master_ready(self, namespace: str, service: str) -> Obj | None:
        """The master's open /ready through the API server's service proxy (RBAC: services/proxy get).
        Its JSON body (200 or 503), or None for anything else; read up to a bound, as it comes from a pod."""
        http = self.client._client._client  # lightkube's httpx client: the API server's URL and credentials
        path = f"/api/v1/namespaces/{namespace}/services/{service}:{C.PORT_NAME_HTTP}/proxy/ready"
        async with http.stream("GET", path, timeout=MASTER_READ_TIMEOUT_S) as resp:
            if resp.status_code not in (200, 503):
                return None
            body = b""
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MASTER_READ_MAX_BYTES:
                    return None
        try:
            out = json.loads(body)
        except ValueError:
            return None
        return out if isinstance(out, dict) else None

    async def post_event(self, event: Obj) -> None:
        with _counted("Event", "create"):
            await self.client.create(EventResource.from_dict(event), namespace=event["metadata"]["namespace"])

    async def write_status(self, namespace: str, name: str, status: Obj) -> None:
        with _counted(C.KIND, "status"):
            await self.client.patch(OmniPipelineResource.Status, name, {"status": status}, namespace=namespace,
                                    patch_type=PatchType.MERGE)


@contextlib.contextmanager
def _counted(kind: str, verb: str) -> Iterator[None]:
    """Count one write (or its failure) for /metrics."""
    try:
        yield
    except asyncio.CancelledError:
        raise
    except BaseException:
        metrics.count_write(kind, verb, ok=False)
        raise
    metrics.count_write(kind, verb, ok=True)


def namespace_terminating(err: BaseException) -> bool:
    """A create refused because its namespace is being deleted. Nothing can be made there any more, and the
    namespace's deletion takes the pipeline with it: no failure to report or retry (Kubernetes' own
    controllers treat it the same)."""
    if not isinstance(err, ApiError) or err.status.code != 403 or err.status.details is None:
        return False
    return any(c.reason == "NamespaceTerminating" for c in err.status.details.causes or ())


def _api_error_text(err: Exception) -> str:
    if isinstance(err, ApiError):
        return f"{err.status.code} {err.status.reason}: {err.status.message}"
    return f"{type(err).__name__}: {err}"


@dataclass
class Writes:
    """One pass's writes: applied, made (create-only), found taken, and the first error."""

    done: list[Obj] = field(default_factory=list)
    created: list[Obj] = field(default_factory=list)
    taken: list[Obj] = field(default_factory=list)  # a create-only apply found the name in use
    ours: list[Obj] = field(default_factory=list)  # of those, this pipeline's (not in the watch yet)
    error: str | None = None
    terminating: bool = False  # a create was refused: the namespace is being deleted

    def record(self, obj: Obj, rv: int | None, cache: AppliedCache | None, created: bool) -> None:
        if cache is not None:
            cache.record(obj, rv)
        self.done.append(obj)
        if created:
            self.created.append(obj)

    async def apply(self, api: Api, objs: list[Obj], cache: AppliedCache | None, create_only: bool = False) -> None:
        results = await asyncio.gather(*(api.apply(o, create_only=create_only) for o in objs), return_exceptions=True)
        for obj, rv in zip(objs, results):
            if isinstance(rv, asyncio.CancelledError):
                raise rv
            if isinstance(rv, Exists):
                self.taken.append(obj)
            elif namespace_terminating(rv):
                self.terminating = True
            elif isinstance(rv, BaseException):  # reported in status; the next pass retries
                self.error = self.error or _api_error_text(rv)
            else:
                self.record(obj, rv, cache, created=create_only)

    async def resolve(self, api: Api, uid: str) -> list[str]:
        """Who holds the names found taken: the names others hold (conflicts)."""
        if not self.taken:
            return []
        try:
            foreign, ours = await _taken(api, self.taken, uid)
        except Exception as err:
            self.error = self.error or _api_error_text(err)
            return []
        finally:
            self.taken = []
        self.ours += ours
        return foreign

    async def undo(self, api: Api, cache: AppliedCache | None) -> None:
        """Delete what this pass made (a name of the pipeline turned out taken)."""
        for obj in self.created:
            try:
                await api.delete(obj)
            except Exception as err:  # left to the pipeline's garbage collection
                self.error = self.error or _api_error_text(err)
            if cache is not None:
                cache.forget(object_key(obj))
        self.done, self.created = [], []


async def _taken(api: Api, objs: list[Obj], uid: str) -> tuple[list[str], list[Obj]]:
    """Of objects whose names a create-only apply found in use: the names others hold, and the live
    objects that are this pipeline's."""
    lives = await asyncio.gather(*(api.get(o) for o in objs))
    foreign = [ref(o) for o, live in zip(objs, lives) if live is not None and not controlled_by(live, uid)]
    return foreign, [live for live in lives if live is not None and controlled_by(live, uid)]


@dataclass
class Outcome:
    applied: int = 0
    deleted: int = 0
    status_written: bool = False
    status_held: bool = False  # a progress-only change not written yet (hold_progress)
    status: Obj = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    # Wrote nothing, and nothing but its inputs (the pipeline and its children as watched) can change that:
    # no error or name conflict to retry, no write waiting for the watch, no master to ask again.
    steady: bool = False


async def reconcile(api: Api, body: Obj, children: Children, last_status: Obj | None = None,
                    cache: AppliedCache | None = None, hold_progress: bool = False, hold_coming_up: bool = False,
                    policy: Policy = Policy(), master_reads: MasterReads | None = None) -> Outcome:
    """One pass. Writes only what differs; never raises for a bad spec.

    `last_status` is the status this operator last wrote for this object: a
    pass that runs before that write comes back through the watch compares
    with it rather than with the older status in `body`, so it neither writes
    the same status twice nor repeats its events. With `hold_progress`, a
    change of progress only (see `status.decisive`) is not written; the
    caller runs the pass again when it wants it written. With `hold_coming_up`,
    a status that says only that the pipeline is coming up (see
    `status.coming_up`) is not written either. With `master_reads`,
    the master's /ready is read when only it can say why a stage waits.
    """
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace", "default"), meta["uid"]
    generation = int(meta.get("generation") or 0)
    outcome = Outcome()
    doc, problems = parse(body, policy)
    apply_error = None
    applied: list[str] = []
    conflicts: list[str] = []
    waiting = False  # objects applied that the watch has not shown yet
    considered: list[Obj] = []  # every child this pass wanted, the keys Secret included
    if doc is not None:
        writes = Writes()
        try:
            secret = render.build_keys_secret(doc, {}, uid)
            live_secret = children.find("v1", "Secret", secret["metadata"]["name"])
            if live_secret is None and cache is not None and cache.knows(secret):
                live_secret = await api.get(secret)  # made by an earlier pass, its ADDED event not seen yet
            new_keys = None
            if usable_keys(live_secret):
                keys_hash = render.secret_data_hash(live_secret["data"])
            else:  # no keys yet (or the Secret was deleted or emptied): new ones; the pods roll onto them
                new_keys = render.build_keys_secret(doc, pipeline_keys(), uid)
                keys_hash = render.secret_data_hash(new_keys["data"])
            # The CR's namespace is where children go, whatever the spec document said.
            wanted = render.desired(doc, owner_uid=uid, keys_hash=keys_hash)
            conflicts = watched_conflicts(wanted, children, uid)
            if live_secret is not None and not controlled_by(live_secret, uid):
                conflicts.append(ref(secret))
            held_before = cache.conflicts.get(uid) if cache is not None else None
            if not conflicts and held_before:
                conflicts, _ = await _taken(api, held_before, uid)
            considered = [*wanted, secret]
            if not conflicts and new_keys is not None:
                try:
                    rv = await api.apply(new_keys, create_only=live_secret is None)
                except Exists:  # made meanwhile: by an earlier pass of this operator, or by someone else
                    conflicts, ours = await _taken(api, [new_keys], uid)
                    keys_hash = next((render.secret_data_hash(o["data"]) for o in ours if usable_keys(o)), None)
                    wanted = render.desired(doc, owner_uid=uid, keys_hash=keys_hash)
                else:
                    writes.record(new_keys, rv, cache, created=live_secret is None)
        except Exception as err:  # the keys Secret read or written, or rendering: in status, retried next pass
            wanted, writes.terminating = [], namespace_terminating(err)  # (a namespace going away is no failure)
            if not writes.terminating:
                apply_error = _api_error_text(err)
                log.warning("%s/%s: preparing the children failed: %s", namespace, name, apply_error)
        if conflicts:
            wanted = []
        elif (held := master_keys_hold(wanted, children)) is not None:
            master = render.build_master_deployment(doc, uid, held)
            wanted = [master if (o["kind"], o["metadata"]["name"]) == ("Deployment", master["metadata"]["name"])
                      else o for o in wanted]
        if without_room := rollouts_without_room(wanted, children):
            log.warning("%s/%s: no room for a surge pod; rolling one replica at a time: %s", namespace, name,
                     ", ".join(without_room))
        todo = plan(wanted, children, uid, cache) if wanted else Plan([], [])
        waiting = bool(todo.pending)
        # Status must not call pending objects observed: what `children` shows of them is older.
        applied += [ref(o) for o in todo.pending]
        # All of a wave's writes at once (Api bounds how many are in flight): one after the other, a few
        # pipelines would leave the apiserver idle between round trips.
        await writes.apply(api, [o for o in todo.create if o["kind"] not in WORKLOAD_KINDS], cache, create_only=True)
        conflicts += await writes.resolve(api, uid)
        if not conflicts and writes.error is None and not writes.terminating:
            await asyncio.gather(
                writes.apply(api, [o for o in todo.create if o["kind"] in WORKLOAD_KINDS], cache, create_only=True),
                writes.apply(api, todo.apply, cache))
            conflicts += await writes.resolve(api, uid)
        if conflicts:
            await writes.undo(api, cache)  # touch nothing: what this pass made goes again
            log.warning("%s/%s: name conflict, touching nothing: %s", namespace, name, ", ".join(conflicts))
        if cache is not None and conflicts:
            cache.conflicts[uid] = [o for o in considered if ref(o) in conflicts]
        elif cache is not None and apply_error is None:
            cache.conflicts.pop(uid, None)
        applied += [ref(o) for o in writes.done + writes.ours]
        outcome.applied += len(writes.done)
        write_error = writes.error
        try:
            for obj in todo.delete if write_error is None and not conflicts and not writes.terminating else ():
                await api.delete(obj)
                outcome.deleted += 1
        except Exception as err:
            write_error = _api_error_text(err)
        if write_error is not None:
            apply_error = write_error
            log.warning("%s/%s: apply failed: %s", namespace, name, apply_error)
        if writes.terminating:
            log.info("%s/%s: the namespace is being deleted: nothing more is made in it", namespace, name)

    deployments = {o["metadata"]["name"]: o for o in children.objects if o.get("kind") == "Deployment"}
    prior = last_status if last_status is not None else (body.get("status") or {})
    observed = Observed(deployments=deployments, pods=children.pods)
    asks_master = master_reads is not None and doc is not None and wants_master_report(doc, observed)
    if asks_master:
        observed = replace(observed, master=await master_reads.report(api, uid, namespace, name))
    elif master_reads is not None:
        master_reads.forget(uid)
    status = compute_status(
        name=name, namespace=namespace, generation=generation, doc=doc, problems=problems,
        observed=observed,
        prior=prior, now=now_iso(), apply_error=apply_error, applied=applied, conflicts=conflicts,
    )
    outcome.status = status
    if status != prior and (hold_progress and decisive(status) == decisive(prior)
                            or hold_coming_up and coming_up(status)):
        outcome.status_held = True
    elif status != prior:
        await api.write_status(namespace, name, status)
        outcome.status_written = True
        # Events only after the status they describe is stored.
        outcome.events = transition_events(prior, status)
    outcome.steady = not (outcome.applied or outcome.deleted or outcome.status_written or outcome.status_held
                          or apply_error or conflicts or waiting or asks_master)
    return outcome
