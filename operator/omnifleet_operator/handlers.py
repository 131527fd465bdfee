"""kopf wiring: watch pipelines (kopf) and their children (watches), reconcile from a queue.

Only an `on.event` handler is used, so kopf itself writes nothing: no finalizers,
no bookkeeping annotations, no status fields of its own. It is a coroutine: kopf
runs a plain function in a thread of its executor, a hand-off per watch event
that cost more than the handler's own work (and the work queue is the event
loop's, which is not thread-safe). The children and their pods are kept by the
operator's own list-and-watch caches (watches.py: kopf's per-event machinery was
most of the operator's CPU in a mass create); the workers start once every cache
has listed, so the first pass already sees every existing child and does not
re-apply them after a restart.
A fixed pool of workers drains a de-duplicating queue; a periodic resync
re-checks every pipeline for drift and writes only differences.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import kopf
from lightkube import AsyncClient

from omnifleet_runtime import constants as C

from . import metrics, watches
from .leader import Elector, LostLeadership
from .metricsapi import MetricsApi, NotInstalled
from .checks import Policy, add_policy_flags
from .reconcile import (Api, AppliedCache, Children, MasterReads, event_object, namespace_terminating, now_iso,
                        object_key, reconcile)
from .status import Event

log = logging.getLogger("omnifleet.operator")

RESYNC_SECONDS = float(os.environ.get("OMNIFLEET_RESYNC_SECONDS", "60"))
WORKERS = int(os.environ.get("OMNIFLEET_WORKERS", "8"))
WATCH_TIMEOUT = int(os.environ.get("OMNIFLEET_WATCH_TIMEOUT", "300"))
# A pipeline's status is written at once when a condition, the phase or the
# observed generation changes, and at most this often for progress alone
# (counters as pods come up): each write is an apiserver write and a watch
# event that queues the pipeline again.
PROGRESS_WRITE_SECONDS = float(os.environ.get("OMNIFLEET_PROGRESS_WRITE_SECONDS", "5"))
OBJECT_WORKER_IDLE_SECONDS = 0.5

# (group, version, plural) of each kind the operator renders; pods only for status.
CHILD_RESOURCES = [
    ("", "v1", "serviceaccounts"),
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("apps", "v1", "deployments"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("", "v1", "secrets"),  # the pipeline's keys: a deleted or edited Secret is acted on at once
    # Served only where the Prometheus Operator's CRDs are installed (kopf warns once otherwise).
    ("monitoring.coreos.com", "v1", "podmonitors"),
]
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
Key = tuple[str, str]


class WorkQueue:
    """Each key at most once in the queue; a key changed while being worked on runs again after.

    An urgent key (a pipeline not reconciled yet, or whose spec changed) goes before the others (passes
    for its children's progress): in a mass create, the last pipeline's children are not made late
    because the first ones' pods came up meanwhile.
    """

    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple[bool, int, Key]] = asyncio.PriorityQueue()
        self._queued: dict[Key, tuple[bool, int]] = {}  # each queued key's live entry; older ones are skipped
        self._active: set[Key] = set()
        self._again: dict[Key, bool] = {}  # keys to queue again when their pass ends: urgent?
        self._added: dict[Key, float] = {}  # when each queued key went in (for /metrics)
        self._seq = 0
        self._urgent = 0  # urgent keys queued

    def add(self, key: Key, urgent: bool = False) -> None:
        if key in self._active:
            self._again[key] = self._again.get(key, False) or urgent
            return
        entry = self._queued.get(key)
        if entry is not None and (entry[0] is False or not urgent):
            return  # queued already, as early as it asks
        self._seq += 1
        self._urgent += urgent
        self._queued[key] = (not urgent, self._seq)
        self._queue.put_nowait((not urgent, self._seq, key))
        if entry is None:
            self._added[key] = time.monotonic()
            metrics.QUEUE_ADDS.labels(name=metrics.QUEUE).inc()

    async def get(self) -> Key:
        while True:
            later, seq, key = await self._queue.get()
            if self._queued.get(key) == (later, seq):
                break
        del self._queued[key]
        self._urgent -= not later
        self._active.add(key)
        metrics.QUEUE_WAIT.labels(name=metrics.QUEUE).observe(time.monotonic() - self._added.pop(key, time.monotonic()))
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._again:
            self.add(key, self._again.pop(key))

    def __len__(self) -> int:
        return len(self._queued)

    def urgent_waiting(self) -> bool:
        return self._urgent > 0


class State:
    def __init__(self) -> None:
        self.queue = WorkQueue()
        self.pipelines: dict[Key, dict[str, Any]] = {}
        self.namespaces: list[str] = []  # --namespace: watch only these; none: all
        self.caches: list[watches.Cache] = []  # the children's and their pods' (see watches)
        self.tasks: list[asyncio.Task] = []
        self.api: Api | None = None
        self.watch_clients: dict[str, AsyncClient] = {}  # by namespace ("": all), for the caches' streams
        self.policy = Policy()  # what this operator was started to allow (flags)
        self.custom_metrics_port = 0  # --custom-metrics-port: 0 serves no custom.metrics.k8s.io
        self.written: dict[str, dict[str, Any]] = {}  # by pipeline uid: the status last written
        self.written_at: dict[str, float] = {}  # by pipeline uid: when (loop time)
        self.held: set[Key] = set()  # pipelines with a progress change waiting to be written
        self.seen: dict[str, int] = {}  # by child uid: a hash of what of it a pass reads (see _matters)
        self.specs: dict[str, tuple[Any, Any]] = {}  # by child uid: (generation, its kept spec), see _keep
        self.applied = AppliedCache()
        self.master_reads = MasterReads()
        # by pipeline: a digest of the inputs of its last pass, kept when that pass was steady (see _inputs)
        self.steady: dict[Key, int] = {}
        self.passes = 0
        self.unchanged = 0  # passes not run: the inputs of a steady pass again
        self.errors = 0
        self.leading = False  # this replica's workers run (it holds the Lease, or there is no election)


STATE = State()


def _phases() -> list[str]:
    """Each known pipeline's phase: what this operator last wrote, else what the object says.
    A follower reports none (the leader does), so sums over replicas count each pipeline once."""
    out: list[str] = []
    if not STATE.leading:
        return out
    for body in list(STATE.pipelines.values()):
        status = STATE.written.get(body["metadata"].get("uid")) or body.get("status") or {}
        out.append(status.get("phase") or "")
    return out


metrics.register_state(lambda: len(STATE.queue) if STATE.leading else 0, _phases, lambda: STATE.leading)


def _plain(body: Any) -> dict[str, Any]:
    """A pipeline as the operator keeps it: all but its managedFields. kopf hands out a fresh raw dict per
    event, so copying only the top level and metadata is a stable snapshot."""
    out = dict(body)
    meta = out.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def _compact(value: Any) -> Any:
    """A copy whose keys and short strings are shared with every other kept object: thousands of children
    repeat the same field names and values, and a JSON decoder makes new strings for each."""
    if isinstance(value, dict):
        return {sys.intern(k): _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    if isinstance(value, str) and len(value) <= 64:
        return sys.intern(value)
    return value


# Of a child's metadata, what nothing reads and every object has a value of its own.
UNREAD_METADATA = frozenset({"managedFields", "creationTimestamp"})
# Of a Deployment's status, what pipeline status and rollouts read; a condition's message only where status
# quotes it (the others' messages and every condition's two timestamps are unique strings per Deployment).
DEPLOYMENT_STATUS_FIELDS = ("observedGeneration", "replicas", "updatedReplicas", "readyReplicas")
QUOTED_CONDITIONS = frozenset({"ReplicaFailure"})


def _deployment_status(st: dict[str, Any]) -> dict[str, Any]:
    out = {k: st[k] for k in DEPLOYMENT_STATUS_FIELDS if k in st}
    out["conditions"] = [{k: c.get(k) for k in (("type", "status", "reason", "message")
                                                   if c.get("type") in QUOTED_CONDITIONS else ("type", "status", "reason"))}
                         for c in st.get("conditions") or ()]
    return out


def _keep(body: Any, deployment: bool) -> dict[str, Any]:
    """What the operator keeps of a child (memory at N pipelines is mostly this): no managedFields
    (nothing reads them; they are as large as the rest again) or creation time, no status unless asked
    (a Deployment's: only what is read of it), strings shared (_compact), and the spec of the last event
    reused while the object's generation holds (most events of a Deployment change only its status)."""
    out: dict[str, Any] = {}
    meta = body["metadata"]
    uid, generation = meta.get("uid"), meta.get("generation")
    for k, v in body.items():
        if k == "metadata":
            out["metadata"] = _compact({mk: mv for mk, mv in v.items() if mk not in UNREAD_METADATA})
        elif k == "status":
            if deployment:
                out["status"] = _compact(_deployment_status(v))
        elif k == "spec" and generation is not None:
            kept = STATE.specs.get(uid)
            if kept is None or kept[0] != generation:
                kept = STATE.specs[sys.intern(uid)] = (generation, _compact(v))
            out["spec"] = kept[1]
        else:
            out[sys.intern(k)] = _compact(v)
    return out


def _spec_fingerprint(body: Any) -> tuple:
    meta = body["metadata"]
    # No generation (ConfigMap, Service, ...): any change counts; such objects change rarely.
    return (meta.get("generation") or meta.get("resourceVersion"), repr(meta.get("labels")),
            repr(meta.get("annotations")))


def _scheduling(body: Any) -> tuple:
    """All that pipeline status reads of a pod (with its labels and template, which the index keeps): its
    scheduling, whether it is going, why its containers last failed, and whether its engines loaded (started)."""
    scheduled = (None, None)
    for c in (body.get("status") or {}).get("conditions") or ():
        if c.get("type") == "PodScheduled":
            scheduled = (c.get("status"), c.get("reason"))
    return scheduled + (bool(body["metadata"].get("deletionTimestamp")),) + tuple(_failure(cs) + (cs.get("started"),)
                             for cs in (body.get("status") or {}).get("containerStatuses") or ())


def _failure(cs: dict[str, Any]) -> tuple:
    waiting = (cs.get("state") or {}).get("waiting") or {}
    last = (cs.get("lastState") or {}).get("terminated") or {}
    return waiting.get("reason"), last.get("exitCode"), last.get("message")


def _matters(event: dict[str, Any], body: Any, fingerprint: Any) -> bool:
    """Whether a watch event can change a pass's outcome. Most events of a mass
    create are status updates nothing reads (PDB and HPA status, pod phases);
    each would queue its whole pipeline for another pass."""
    if fingerprint is None:
        return True
    uid = sys.intern(body["metadata"].get("uid") or "")  # the kept metadata's string: one per child, not two
    if event.get("type") == "DELETED":
        STATE.seen.pop(uid, None)
        return True
    now = hash(fingerprint(body))  # kept for every child: a hash, not the labels' and annotations' text
    if STATE.seen.get(uid) == now:
        return False
    STATE.seen[uid] = now
    return True


def _child_cache(group: str, version: str, plural: str) -> watches.Cache:
    # Pipeline status reads a Deployment's status, and of no other kind; other kinds matter only for what
    # they say (their generation) and their labels.
    deployment = plural == "deployments"
    fingerprint = None if deployment else _spec_fingerprint

    def keep(body: dict[str, Any]) -> dict[str, Any]:
        return _keep(body, deployment)

    def changed(kind: str | None, body: dict[str, Any], key: Key) -> None:
        if kind == "DELETED":
            STATE.applied.forget(object_key(body))
            STATE.specs.pop(body["metadata"].get("uid"), None)
        if _matters({"type": kind}, body, fingerprint):
            STATE.queue.add(key)

    return watches.Cache(group, version, plural, keep, changed, STATE.namespaces, WATCH_TIMEOUT)


POD_CONTAINER_FIELDS = ("name", "state", "lastState", "restartCount", "started")


def _keep_pod(body: dict[str, Any]) -> dict[str, Any]:
    """Only what status needs of a pod: its stage and template (its revision), whether it is going, its
    conditions, why its containers failed, whether they started."""
    st, meta = body.get("status") or {}, body["metadata"]
    kept = {"name": meta["name"], "labels": dict(meta.get("labels") or {}),
            "resourceVersion": meta.get("resourceVersion")}
    template = (meta.get("annotations") or {}).get(C.ANNOTATION_TEMPLATE_HASH)
    if template:
        kept["annotations"] = {C.ANNOTATION_TEMPLATE_HASH: template}
    if meta.get("deletionTimestamp"):
        kept["deletionTimestamp"] = meta["deletionTimestamp"]
    return {"metadata": kept,
            "status": {"conditions": list(st.get("conditions") or []),
                       "containerStatuses": [{k: cs.get(k) for k in POD_CONTAINER_FIELDS}
                                             for cs in st.get("containerStatuses") or []]}}


def _pod_cache() -> watches.Cache:
    def changed(kind: str | None, body: dict[str, Any], key: Key) -> None:
        if _matters({"type": kind}, body, _scheduling):
            STATE.queue.add(key)

    return watches.Cache("", "v1", "pods", _keep_pod, changed, STATE.namespaces, WATCH_TIMEOUT)


@kopf.on.event(C.GROUP, C.VERSION, C.PLURAL)
async def pipeline_event(event: dict[str, Any], namespace: str, name: str, body: Any, **kwargs: Any) -> None:
    key = (namespace, name)
    if event.get("type") == "DELETED":
        STATE.pipelines.pop(key, None)
        STATE.steady.pop(key, None)
        STATE.written.pop(body["metadata"].get("uid"), None)
        STATE.written_at.pop(body["metadata"].get("uid"), None)
        STATE.master_reads.forget(body["metadata"].get("uid"))
        STATE.applied.conflicts.pop(body["metadata"].get("uid"), None)
        return  # children go by garbage collection (owner references)
    known = STATE.pipelines.get(key)
    STATE.pipelines[key] = _plain(body)
    if known is None or _pipeline_fingerprint(known) != _pipeline_fingerprint(body):
        uid = body["metadata"].get("uid")
        STATE.queue.add(key, urgent=uid not in STATE.written or known is not None)


def _pipeline_fingerprint(body: Any) -> tuple:
    """All of a pipeline that a pass reads but its status: most of its events are status writes (this
    operator's own, each echoed back), and a pass compares with the status it wrote, not the body's."""
    meta = body["metadata"]
    return meta.get("uid"), meta.get("generation"), meta.get("deletionTimestamp")


def children_of(key: Key) -> Children:
    out = Children()
    for cache in STATE.caches:
        (out.pods if cache.plural == "pods" else out.objects).extend(cache.get(key))
    return out


async def _work() -> None:
    controller = metrics.CONTROLLER
    # The first pass of a pipeline sees every child that exists (none is applied again after a restart).
    await asyncio.gather(*(cache.listed.wait() for cache in STATE.caches))
    while True:
        key = await STATE.queue.get()
        started, result = time.monotonic(), "error"
        metrics.ACTIVE_WORKERS.labels(controller).inc()
        try:
            body = STATE.pipelines.get(key)
            live = body is not None and not body["metadata"].get("deletionTimestamp")
            children = children_of(key) if live else Children()
            inputs = _inputs(body, children) if live else None
            skipped = live and STATE.steady.get(key) == inputs
            if skipped:
                STATE.unchanged += 1
            elif live:
                STATE.steady.pop(key, None)
                uid = body["metadata"]["uid"]
                loop = asyncio.get_running_loop()
                write_from = STATE.written_at.get(uid, -PROGRESS_WRITE_SECONDS) + PROGRESS_WRITE_SECONDS
                # While new or changed pipelines wait for their pass, a status saying only "coming up" waits
                # behind them (a held key goes back to the queue, not urgent): in a mass create the apiserver
                # makes children first, and a pipeline further on by then skips the steps between.
                outcome = await reconcile(STATE.api, body, children, last_status=STATE.written.get(uid),
                                          cache=STATE.applied, hold_progress=loop.time() < write_from,
                                          hold_coming_up=STATE.queue.urgent_waiting(),
                                          policy=STATE.policy, master_reads=STATE.master_reads)
                if outcome.steady:
                    STATE.steady[key] = inputs
                if outcome.status_written:
                    STATE.written[uid] = outcome.status
                    STATE.written_at[uid] = loop.time()
                elif outcome.status_held and key not in STATE.held:
                    STATE.held.add(key)
                    loop.call_at(write_from, _release_held, key)
                STATE.passes += 1
                for ev in outcome.events:
                    await _post_event(body, ev)
                if outcome.applied or outcome.deleted:
                    log.info("%s/%s: applied %d, deleted %d", *key, outcome.applied, outcome.deleted)
            result = "" if skipped else "success"
        except asyncio.CancelledError:
            result = ""
            raise
        except Exception:
            STATE.errors += 1
            metrics.RECONCILE_ERRORS.labels(controller).inc()
            log.exception("%s/%s: reconcile failed; retrying on the next resync", *key)
        finally:
            metrics.ACTIVE_WORKERS.labels(controller).dec()
            if result:
                metrics.RECONCILE_TOTAL.labels(controller, result).inc()
                metrics.RECONCILE_TIME.labels(controller).observe(time.monotonic() - started)
            STATE.queue.done(key)


def _inputs(body: dict[str, Any], children: Children) -> int:
    """A digest of all a pass reads that can change: the pipeline but its status (which a pass compares with
    what it wrote), and each child as the watch last showed it (every change of one is a new
    resourceVersion). The same inputs as a steady pass give the same nothing, so a resync of a settled
    pipeline costs this, not a parse, render and compare; a child changed behind a missed watch event is no
    different to a pass, which reads the same watch caches."""
    meta = body["metadata"]
    return hash((_pipeline_fingerprint(body), repr(meta.get("labels")), repr(meta.get("annotations")),
                 tuple((o.get("kind"), o["metadata"].get("name"), o["metadata"].get("resourceVersion"))
                       for o in children.objects),
                 tuple((p["metadata"].get("name"), p["metadata"].get("resourceVersion")) for p in children.pods)))


def _release_held(key: Key) -> None:
    STATE.held.discard(key)
    STATE.queue.add(key)


async def _post_event(body: dict[str, Any], ev: Event) -> None:
    # Posted through our own client: kopf.event() only works inside kopf's own
    # handler tasks (it needs their context), and these workers are not ones.
    try:
        await STATE.api.post_event(event_object(body, ev, now_iso(), socket.gethostname()))
    except asyncio.CancelledError:
        raise
    except Exception as err:  # an event is best effort: the status already says it
        if namespace_terminating(err):
            return
        log.warning("%s/%s: posting event %s failed: %s", body["metadata"].get("namespace"),
                    body["metadata"]["name"], ev.reason, err)


async def _resync() -> None:
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        for key in list(STATE.pipelines):
            STATE.queue.add(key)


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """No diff base. kopf builds one for every watch event of every watched object
    (two deep copies of the whole body, managedFields included) to find changes for
    change handlers; with only on.event and index handlers nothing reads it (it was
    about half of the operator's CPU under cProfile, bench/control_plane.py). Adding
    an on.create/update/field handler would need kopf's default storage back."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: Any) -> Any:
        return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.peering.standalone = True
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.scanning.disabled = True
    settings.watching.server_timeout = WATCH_TIMEOUT
    # kopf keeps a task and a queue per object for this long after its last event (default 5 s): in a mass
    # create, that is every child at once. One ended early costs little: the next event of its object starts another.
    settings.queueing.idle_timeout = OBJECT_WORKER_IDLE_SECONDS
    settings.watching.client_timeout = WATCH_TIMEOUT + 10
    settings.networking.error_backoffs = [1, 2, 5]
    STATE.api = Api(applies_in_flight=WORKERS)
    # Each namespace's streams get a client of their own (lightkube's, for the API server's URL and
    # credentials): a stream holds its connection, and one pool of 100 would not hold every stream of many
    # namespaces, nor leave the workers' writes a connection.
    STATE.watch_clients = {ns: AsyncClient(field_manager=C.FIELD_MANAGER) for ns in STATE.namespaces or [""]}
    STATE.caches = [_child_cache(*kind) for kind in CHILD_RESOURCES] + [_pod_cache()]
    for cache in STATE.caches:
        _spawn(cache.run(lambda ns: STATE.watch_clients[ns]._client._client))
    if STATE.custom_metrics_port:
        _spawn(_serve_custom_metrics(STATE.custom_metrics_port))
    lease_ns = os.environ.get(ENV_LEADER_ELECTION_NAMESPACE)
    if lease_ns:
        _spawn(_lead(lease_ns))
    else:
        _start_workers()


def _spawn(coro: Coroutine[Any, Any, None]) -> None:
    """Start one of the operator's own tasks, which run until cleanup cancels them."""
    task = asyncio.create_task(coro)
    task.add_done_callback(_ended)
    STATE.tasks.append(task)


def _ended(task: asyncio.Task) -> None:
    """A task that ended by itself is a fault: exit, so that Kubernetes restarts the replica, rather than go on
    looking alive (kopf's health endpoint still answers) while nothing elects, reconciles or resyncs."""
    if task.cancelled():
        return
    log.critical("the operator's task %s ended (%r): exiting", task.get_coro().__qualname__, task.exception())
    os._exit(1)


async def _serve_custom_metrics(port: int) -> None:
    """Every replica serves (reads only); a failure to start is retried, never fatal to reconciling."""
    server = MetricsApi(STATE.api.client, _own_namespace(), port)
    said = False
    while True:
        try:
            await server.start()
            break
        except NotInstalled as e:
            if not said:
                log.info("not serving custom.metrics.k8s.io (checked again every 30 s): %s", e)
                said = True
            await asyncio.sleep(30)
        except Exception as e:  # noqa: BLE001 - said, and tried again
            log.error("cannot serve custom.metrics.k8s.io yet (retrying in 10 s): %s", e)
            await server.close()
            await asyncio.sleep(10)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


def _own_namespace() -> str:
    try:
        return Path(SA_NAMESPACE_FILE).read_text().strip()
    except OSError:
        return os.environ.get(ENV_LEADER_ELECTION_NAMESPACE) or "omnifleet-system"


def _start_workers() -> None:
    STATE.leading = True
    for _ in range(WORKERS):
        _spawn(_work())
    _spawn(_resync())


async def _lead(namespace: str) -> None:
    """Reconcile only while holding the Lease; exit when it is lost (restarted as a follower)."""
    elector = Elector(STATE.api.client, namespace, os.environ.get(C.ENV_POD_NAME) or socket.gethostname())
    await elector.acquire()
    _start_workers()
    for key in list(STATE.pipelines):  # what changed while following
        STATE.queue.add(key)
    try:
        await elector.hold()
    except LostLeadership as e:
        log.error("%s: exiting so that only one replica writes", e)
        os._exit(1)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    for task in STATE.tasks:
        task.cancel()
    await asyncio.gather(*STATE.tasks, return_exceptions=True)
    STATE.tasks = []
    if STATE.api is not None:
        await STATE.api.client.close()
    for client in STATE.watch_clients.values():
        await client.close()
    STATE.watch_clients = {}


# Set (to the operator's namespace) when several replicas run: only the holder of a Lease there writes.
ENV_LEADER_ELECTION_NAMESPACE = "OMNIFLEET_LEADER_ELECTION_NAMESPACE"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="omnifleet operator", description="Run the OmniPipeline operator.")
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="kopf liveness endpoint (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=metrics.DEFAULT_PORT,
                        help="port of /metrics (Prometheus text) on all interfaces; 0 serves none "
                             "(default: %(default)s)")
    parser.add_argument("--custom-metrics-port", type=int, default=0,
                        help="serve custom.metrics.k8s.io (the autoscaled stages' series, for their HPAs) over "
                             "HTTPS on this port; needs the APIService of manifests/autoscaling/; 0 serves none "
                             "(default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true")
    add_policy_flags(parser)
    args = parser.parse_args(argv)
    STATE.policy = Policy.from_flags(args)
    STATE.custom_metrics_port = args.custom_metrics_port
    STATE.namespaces = list(args.namespace)
    kopf.configure(verbose=args.verbose)  # kopf's own log format, for every logger
    metrics.count_watch_restarts(args.verbose)
    metrics.MAX_WORKERS.labels(metrics.CONTROLLER).set(WORKERS)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    if not args.verbose:  # else one line per request and per handler call
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # kopf would name itself after the user, and a container's uid need not have a passwd entry.
    identity = os.environ.get(C.ENV_POD_NAME) or socket.gethostname()
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness, identity=identity)
    return 0
