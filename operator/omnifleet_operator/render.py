"""`desired(pipeline) -> objects`: pure builders of every child of an OmniPipeline.

No client, no clock, no network: the same input always renders the same
objects, so the reconciler can compare them with what is live and the golden
tests can pin them down.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import yaml

from omnifleet_runtime import constants as C
from omnifleet_runtime.config import ROUTING_FIELDS
from omnifleet_runtime.schema import (AUTOSCALING_METRICS, EnvVar, OmniPipeline, Resources, Rollout, Toleration,
                                      Volume, VolumeMount)
from omnifleet_runtime.validate import dump, resolve

from . import names, quantity

Obj = dict[str, Any]

RUN_AS_USER = 1000
STAGE_GRACE_SECONDS = 120
MASTER_GRACE_SECONDS = 30
STAGE_PROGRESS_DEADLINE = 1800  # model loads are slow
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
SCALE_FIELDS = ("replicas", "autoscaling")
# Pod fields no process reads: they change the template (and so roll the pods) but not the config hash.
POD_ONLY_FIELDS = ("podAnnotations",)


def stable_hash(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def startup_failures(group) -> int:
    """Startup probe failures (10 s apart) a stage pod is allowed: its slowest engine start timeout, and a minute."""
    longest = max(s.engine_start_timeout_seconds or C.ENGINE_START_TIMEOUT_S for s in group)
    return -(-longest // 10) + 6


def namespace_of(doc: OmniPipeline) -> str:
    return doc.metadata.namespace or "default"


def prune(value: Any) -> Any:
    """Drop empty maps and lists: parsing fills them back in, and the config stays short."""
    if isinstance(value, dict):
        return {k: prune(v) for k, v in value.items() if v not in ({}, [])}
    if isinstance(value, list):
        return [prune(v) for v in value]
    return value


_RESOLVED: list[Any] = [None, None, None]  # the document last rendered, its resolved form, that form's dump


def _resolved(doc: OmniPipeline) -> tuple[OmniPipeline, dict[str, Any]]:
    """resolve(doc) and its dump (read only), once per document: a render asks for them for the config and
    every Deployment, and they were most of its cost. Keyed by identity: a parsed document is never changed,
    and the next pass parses a new one."""
    if _RESOLVED[0] is not doc:
        resolved = resolve(doc)
        _RESOLVED[:] = [doc, resolved, dump(resolved)]
    return _RESOLVED[1], _RESOLVED[2]


_CONFIG_TEXTS: dict[bytes, str] = {}  # digest of the pruned resolved pipeline's repr -> its YAML
_CONFIG_TEXTS_MAX = 4096


def config_text(doc: OmniPipeline) -> str:
    """The mounted config: the resolved pipeline, exactly what the runtime parses.

    YAML-dumping it is most of the cost of `desired`, which the operator calls on
    every pass over every pipeline: the text is memoized by content (repr keeps
    1, 1.0, True and "1" apart), so an unchanged pipeline is dumped once.
    """
    data = prune(_resolved(doc)[1])
    key = hashlib.sha256(repr(data).encode()).digest()
    text = _CONFIG_TEXTS.get(key)
    if text is None:
        if len(_CONFIG_TEXTS) >= _CONFIG_TEXTS_MAX:
            _CONFIG_TEXTS.clear()
        text = _CONFIG_TEXTS[key] = yaml.safe_dump(data, sort_keys=True)
    return text


def group_view(doc: OmniPipeline, host: str) -> Obj:
    """What a host stage's pods read from the config: its group and the defaults."""
    d = _resolved(doc)[1]["spec"]
    # Scale-only fields stay out, so scaling never restarts pods.
    group = [{k: v for k, v in s.items() if k not in SCALE_FIELDS + POD_ONLY_FIELDS and not _unset_since(k, v)}
             for s in d["stages"] if s["name"] == host or s.get("colocateWith") == host]
    return {k: d.get(k) for k in ("model", "image", "modelVolume", "security")} | {"stages": group} | _heartbeat(d)


def master_view(doc: OmniPipeline) -> Obj:
    """What the master reads: routing and request defaults, not engine settings.

    It covers every stage's ROUTING_FIELDS, and a stage's own pods roll when
    those change, so master and stages always agree on them after a rollout.
    """
    keep = ROUTING_FIELDS + ("model", "samplingParams", "loras", "promptExpand")
    d = _resolved(doc)[1]["spec"]
    # Scaling the masters rolls none of them.
    master = {k: v for k, v in d["master"].items() if k not in POD_ONLY_FIELDS + ("replicas",)}
    return {"model": d.get("model"), "master": master, "security": d["security"],
            "stages": [{k: s[k] for k in keep if k in s and not _unset_since(k, s[k])} | _from_zero(s)
                       for s in d["stages"]]} | _heartbeat(d)


# Stage fields added after pods were running: left out of the views while empty, so that pods of pipelines
# that do not use them keep their config hashes across an operator upgrade (no restart for nothing).
ADDED_LATER = ("loras",)


def _unset_since(key: str, value: Any) -> bool:
    return key in ADDED_LATER and value in ([], {}, None)


def _from_zero(stage: Obj) -> Obj:
    """A host stage whose pods may scale to zero: the master holds requests for the first replica (of it
    and of the stages co-located with it). Only what the master reads, maxReplicas pinned, so that
    scaling edits never roll the masters."""
    a = stage.get("autoscaling") or {}
    if a.get("minReplicas") != 0:
        return {}
    return {"autoscaling": {"minReplicas": 0, "maxReplicas": 1, "metric": "inflight"}
            | {k: a[k] for k in ("activationTimeoutSeconds",) if k in a}}


def _heartbeat(spec: Obj) -> Obj:
    # Only when set, so pipelines without it keep their hashes (and their pods).
    return {"heartbeat": spec["heartbeat"]} if "heartbeat" in spec else {}


def labels(doc: OmniPipeline, component: str | None = None, stage: str | None = None) -> dict[str, str]:
    out = {
        C.LABEL_NAME: "omnifleet",
        C.LABEL_INSTANCE: doc.metadata.name,
        C.LABEL_PART_OF: "omnifleet",
        C.LABEL_MANAGED_BY: "omnifleet-operator",
        C.LABEL_PIPELINE: doc.metadata.name,
    }
    if component:
        out[C.LABEL_COMPONENT] = component
        out[C.LABEL_OF_COMPONENT] = component
    if stage:
        out[C.LABEL_STAGE] = stage
    return out


def selector(doc: OmniPipeline, component: str, stage: str | None = None) -> dict[str, str]:
    """Selector labels: a subset of `labels` that never changes for an object's life."""
    out = {C.LABEL_PIPELINE: doc.metadata.name, C.LABEL_OF_COMPONENT: component}
    if stage:
        out[C.LABEL_STAGE] = stage
    return out


def metadata(doc: OmniPipeline, name: str, lbls: dict[str, str], owner_uid: str | None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace_of(doc), "labels": lbls}
    if owner_uid:
        meta["ownerReferences"] = [{
            "apiVersion": C.API_VERSION, "kind": C.KIND, "name": doc.metadata.name,
            "uid": owner_uid, "controller": True, "blockOwnerDeletion": True,
        }]
    return meta


# -- pod pieces ---------------------------------------------------------------

POD_SECURITY = {
    "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,  # writes go to the emptyDirs below: /tmp (caches, HOME) and /dev/shm
    "seccompProfile": {"type": "RuntimeDefault"},
}
DOWNWARD_ENV = [
    {"name": C.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": C.ENV_POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
]


def env_list(*groups: list[EnvVar], extra: list[Obj] = ()) -> list[Obj]:
    # A name set twice would make the apply fail (env is a map keyed by name): the later one wins.
    merged: dict[str, Obj] = {e["name"]: e for e in extra}
    for group in groups:
        for e in group:
            merged[e.name] = e.model_dump(by_alias=True, exclude_none=True)
    return list(merged.values())


def tolerations_list(*groups: list[Toleration], extra: list[Obj] = ()) -> list[Obj]:
    out = list(extra)
    for group in groups:
        for t in group:
            d = t.model_dump(by_alias=True, exclude_none=True)
            if d not in out:
                out.append(d)
    return out


def resources_of(parts: list[Resources], gpus: int) -> Obj:
    """One container's resources: co-located stages' amounts add up."""
    out: Obj = {}
    for kind in ("requests", "limits"):
        keys = sorted({k for r in parts for k in getattr(r, kind)})
        merged = {}
        for k in keys:
            values = [getattr(r, kind)[k] for r in parts if k in getattr(r, kind)]
            merged[k] = values[0] if len(values) == 1 else quantity.add(*values)
        if merged:
            out[kind] = merged
    if gpus > 0:
        out.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
        out.setdefault("requests", {}).pop(GPU_RESOURCE, None)
    return out


def config_volume(doc: OmniPipeline) -> Obj:
    return {"name": "config", "configMap": {"name": names.config_name(doc.metadata.name)}}


CONFIG_MOUNT = {"name": "config", "mountPath": C.CONFIG_DIR, "readOnly": True}
TMP_VOLUME = {"name": "tmp", "emptyDir": {}}
TMP_MOUNT = {"name": "tmp", "mountPath": C.TMP_DIR}


def user_volumes(*groups: list[Volume]) -> list[Obj]:
    out: dict[str, Obj] = {}
    for group in groups:
        for v in group:
            out.setdefault(v.name, v.model_dump(by_alias=True, exclude_none=True))
    return list(out.values())


def user_mounts(*groups: list[VolumeMount]) -> list[Obj]:
    out: dict[str, Obj] = {}
    for group in groups:
        for m in group:
            out.setdefault(m.mount_path, m.model_dump(by_alias=True, exclude_none=True))
    return list(out.values())


# The pipeline's keys: a whole volume, not subPath, so an edited Secret reaches running pods' files.
KEYS_MOUNT = {"name": "keys", "mountPath": C.KEYS_DIR, "readOnly": True}
KEYS_MODE = 0o440  # owner root, group fsGroup: the runtime's user reads, nobody writes


def keys_volume(doc: OmniPipeline) -> Obj:
    return {"name": "keys", "secret": {"secretName": names.keys_secret_name(doc.metadata.name),
                                       "defaultMode": KEYS_MODE}}


def keys_annotation(template: Obj, keys_hash: str | None) -> None:
    """A hash of the Secret's data on the pod template: new keys roll the pods."""
    if keys_hash is not None:
        template["metadata"]["annotations"][C.ANNOTATION_KEYS_HASH] = keys_hash


def http_probe(path: str, port: str, period: int, failures: int) -> Obj:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 3, "failureThreshold": failures}


def pod_spec(doc: OmniPipeline, container: Obj, volumes: list[Obj], grace: int, *,
             node_selector: dict[str, str], tolerations: list[Obj], affinity: Obj | None) -> Obj:
    spec: Obj = {
        "serviceAccountName": names.service_account_name(doc.metadata.name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # thousands of Services would otherwise become env vars
        "securityContext": POD_SECURITY,
        "terminationGracePeriodSeconds": grace,
        "containers": [container],
        "volumes": volumes,
    }
    if doc.spec.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in doc.spec.image_pull_secrets]
    if node_selector:
        spec["nodeSelector"] = dict(sorted(node_selector.items()))
    if tolerations:
        spec["tolerations"] = tolerations
    if affinity:
        spec["affinity"] = affinity
    return spec


def with_template_hash(deployment: Obj) -> Obj:
    """Stamp the pod template's hash (replicas are outside the template, so scaling never rolls)."""
    template = deployment["spec"]["template"]
    digest = stable_hash(template)
    template["metadata"].setdefault("annotations", {})[C.ANNOTATION_TEMPLATE_HASH] = digest
    deployment["metadata"].setdefault("annotations", {})[C.ANNOTATION_TEMPLATE_HASH] = digest
    return deployment


# -- objects ------------------------------------------------------------------

def build_service_account(doc: OmniPipeline, owner_uid: str | None = None) -> Obj:
    return {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": metadata(doc, names.service_account_name(doc.metadata.name), labels(doc), owner_uid),
        "automountServiceAccountToken": False,
    }


def build_config_map(doc: OmniPipeline, owner_uid: str | None = None) -> Obj:
    text = config_text(doc)
    meta = metadata(doc, names.config_name(doc.metadata.name), labels(doc), owner_uid)
    meta["annotations"] = {C.ANNOTATION_CONFIG_HASH: stable_hash(text)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {C.CONFIG_FILE: text}}


def build_master_deployment(doc: OmniPipeline, owner_uid: str | None = None, keys_hash: str | None = None) -> Obj:
    m = doc.spec.master
    name = names.master_name(doc.metadata.name)
    container = {
        "name": "master",
        "image": doc.spec.image,
        "command": ["omnifleet"],
        "args": ["master", "--config", C.CONFIG_PATH],
        "ports": [
            {"name": C.PORT_NAME_HTTP, "containerPort": m.api_port, "protocol": "TCP"},
            {"name": C.PORT_NAME_CONTROL, "containerPort": C.MASTER_CONTROL_PORT, "protocol": "TCP"},
            # Not in the master Service: reached through the pod (port-forward) or the sources
            # spec.master.adminSources lets in.
            {"name": C.PORT_NAME_ADMIN, "containerPort": C.MASTER_ADMIN_PORT, "protocol": "TCP"},
        ],
        "env": env_list(m.env, extra=DOWNWARD_ENV + master_secret_env(doc)),
        "resources": resources_of([m.resources], 0),
        # Ready once every stage registered with it (or a warm-up passed): a new master then takes requests
        # it can serve. Stages find masters through the headless Service, which lists unready ones too.
        # Pipeline readiness is /ready, read by the operator and by clients.
        "startupProbe": http_probe("/health", C.PORT_NAME_HTTP, 2, 60),
        "readinessProbe": http_probe("/readyz", C.PORT_NAME_HTTP, 5, 3),
        "livenessProbe": http_probe("/health", C.PORT_NAME_HTTP, 10, 6),
        "volumeMounts": [CONFIG_MOUNT, KEYS_MOUNT, TMP_MOUNT, *user_mounts(m.volume_mounts)],
        "securityContext": CONTAINER_SECURITY,
        # A crash's last log lines (the reason) show in the pod's status and `kubectl describe`.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template = {
        "metadata": {
            "labels": labels(doc, C.COMPONENT_MASTER),
            "annotations": dict(sorted(m.pod_annotations.items())) | {
                C.ANNOTATION_CONFIG_HASH: stable_hash(master_view(doc))},
        },
        "spec": pod_spec(doc, container,
                         [config_volume(doc), keys_volume(doc), TMP_VOLUME, *user_volumes(m.volumes)],
                         MASTER_GRACE_SECONDS,
                         node_selector=m.node_selector, tolerations=tolerations_list(m.tolerations),
                         affinity=None),
    }
    keys_annotation(template, keys_hash)
    return with_template_hash({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(doc, name, labels(doc, C.COMPONENT_MASTER), owner_uid),
        "spec": {
            "replicas": doc.spec.master.replicas,
            # Every stage replica registers with every master (through the masters' headless Service), so
            # a new master serves beside the old ones, and an old one drains on SIGTERM what it holds.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector(doc, C.COMPONENT_MASTER)},
            "template": template,
        },
    })


def master_secret_env(doc: OmniPipeline) -> list[Obj]:
    """The API key and the admin token, read from the Secrets the spec names (never from the ConfigMap)."""
    m = doc.spec.master
    out = []
    for env, ref in ((C.ENV_API_KEY, m.api_key_secret), (C.ENV_ADMIN_TOKEN, m.admin_token_secret)):
        if ref is not None:
            out.append({"name": env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return out


def build_master_service(doc: OmniPipeline, owner_uid: str | None = None) -> Obj:
    m = doc.spec.master
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(doc, names.master_name(doc.metadata.name), labels(doc, C.COMPONENT_MASTER), owner_uid),
        "spec": {
            "type": m.service_type,
            "selector": selector(doc, C.COMPONENT_MASTER),
            "ports": [
                {"name": C.PORT_NAME_HTTP, "port": m.api_port, "targetPort": C.PORT_NAME_HTTP, "protocol": "TCP"},
                {"name": C.PORT_NAME_CONTROL, "port": C.MASTER_CONTROL_PORT,
                 "targetPort": C.PORT_NAME_CONTROL, "protocol": "TCP"},
            ],
        },
    }


def build_masters_service(doc: OmniPipeline, owner_uid: str | None = None) -> Obj:
    """Headless: its name resolves to every master's pod IP, and each stage replica registers with each.

    Not-ready masters are listed too: a new master is ready only once the stages registered with it
    (its /readyz), and a master failing its probe under load must keep its stages, not lose them to a
    DNS change.
    """
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(doc, names.masters_name(doc.metadata.name), labels(doc, C.COMPONENT_MASTER), owner_uid),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(doc, C.COMPONENT_MASTER),
            "ports": [{"name": C.PORT_NAME_CONTROL, "port": C.MASTER_CONTROL_PORT,
                       "targetPort": C.PORT_NAME_CONTROL, "protocol": "TCP"}],
        },
    }


def build_master_pdb(doc: OmniPipeline, owner_uid: str | None = None) -> Obj | None:
    """With several masters, a node drain or the cluster autoscaler takes them one at a time (one master
    alone has no spare: a PDB would only block drains)."""
    if doc.spec.master.replicas < 2:
        return None
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": metadata(doc, names.master_name(doc.metadata.name), labels(doc, C.COMPONENT_MASTER), owner_uid),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(doc, C.COMPONENT_MASTER)}},
    }


def build_stage_deployment(doc: OmniPipeline, host: str, owner_uid: str | None = None,
                           keys_hash: str | None = None) -> Obj:
    resolved = _resolved(doc)[0]
    group = resolved.spec.group(host)
    h = group[0]
    p = doc.metadata.name
    args = ["stage", "--config", C.CONFIG_PATH]
    for s in group:
        args += ["--stage", s.name]
    args += ["--master", names.masters_address(p, namespace_of(doc))]
    ports = [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in zmq_ports(doc, len(group))]
    ports.append({"name": C.PORT_NAME_HEALTH, "containerPort": C.STAGE_HEALTH_PORT, "protocol": "TCP"})
    ports.append({"name": C.PORT_NAME_METRICS, "containerPort": C.STAGE_METRICS_PORT, "protocol": "TCP"})
    pod_ip = {"name": C.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    mounts = [CONFIG_MOUNT, KEYS_MOUNT, TMP_MOUNT, {"name": "dshm", "mountPath": C.SHM_DIR}]
    shm = quantity.add(*(s.shm_size for s in group))
    volumes = [config_volume(doc), keys_volume(doc), TMP_VOLUME,
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    mv = doc.spec.model_volume
    if mv:
        mount = {"name": "models", "mountPath": C.MODEL_DIR, "readOnly": True}
        if mv.sub_path:
            mount["subPath"] = mv.sub_path
        mounts.append(mount)
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": mv.claim_name, "readOnly": True}}
                       if mv.claim_name else {"name": "models", "hostPath": {"path": mv.host_path, "type": "Directory"}})
    volumes += user_volumes(*(s.volumes for s in group))
    mounts += user_mounts(*(s.volume_mounts for s in group))
    container = {
        "name": "stage",
        "image": h.image,
        "command": ["omnifleet"],
        "args": args,
        "ports": ports,
        "env": env_list(*(s.env for s in group), extra=DOWNWARD_ENV + [pod_ip]),
        "resources": resources_of([s.resources for s in group], h.gpus),
        # Started: every engine loaded. The probe outlasts the engines' own start timeout (they load at
        # once, one process each), which stops a load that hangs with the reason in its last log line.
        # Ready: registered with a master and not draining, so ready replicas are registered ones.
        "startupProbe": http_probe("/startedz", C.PORT_NAME_HEALTH, 10, startup_failures(group)),
        "readinessProbe": http_probe("/readyz", C.PORT_NAME_HEALTH, 5, 3),
        "livenessProbe": http_probe("/livez", C.PORT_NAME_HEALTH, 10, 6),
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
        # A stage that cannot load its engine exits with the reason as its last log line.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    node_selector: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for s in group:
        node_selector |= s.node_selector
        annotations |= s.pod_annotations
    tolerations = tolerations_list(*(s.tolerations for s in group), extra=[GPU_TOLERATION] if h.gpus else [])
    template = {
        "metadata": {
            "labels": labels(doc, C.COMPONENT_STAGE, host),
            "annotations": dict(sorted(annotations.items())) | {
                C.ANNOTATION_CONFIG_HASH: stable_hash(group_view(doc, host)),
                C.ANNOTATION_STAGES: ",".join(s.name for s in group),
            },
        },
        "spec": pod_spec(doc, container, volumes, STAGE_GRACE_SECONDS,
                         node_selector=node_selector, tolerations=tolerations, affinity=h.affinity),
    }
    keys_annotation(template, keys_hash)
    r = doc.spec.rollout or Rollout()
    spec: Obj = {
        # By default capacity is kept during a roll (a surge pod waits for a GPU if none is free). A new pod
        # is ready once its whole revision is registered, so the old pods of every stage serve until then.
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": r.max_surge, "maxUnavailable": r.max_unavailable}},
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": STAGE_PROGRESS_DEADLINE,
        "selector": {"matchLabels": selector(doc, C.COMPONENT_STAGE, host)},
        "template": template,
    }
    if h.autoscaling is None:
        spec = {"replicas": h.replicas} | spec  # an autoscaled stage's replicas belong to its HPA
    meta = metadata(doc, names.stage_name(p, host), labels(doc, C.COMPONENT_STAGE, host), owner_uid)
    return with_template_hash({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec})


def zmq_ports(doc: OmniPipeline, stages: int) -> list[tuple[str, int]]:
    """(name, port) of a stage pod's ZMQ ports: a data port per co-located stage, and with a `curve` data plane
    a bulk port beside each (large messages, AES-GCM sealed, their keys over the data port's CurveZMQ)."""
    ports = [(names.data_port_name(i), C.STAGE_DATA_PORT + i) for i in range(stages)]
    if doc.spec.security.data_plane == "curve":
        ports += [(names.bulk_port_name(i), C.STAGE_DATA_PORT + C.BULK_PORT_OFFSET + i) for i in range(stages)]
    return ports


def build_stage_service(doc: OmniPipeline, host: str, owner_uid: str | None = None) -> Obj:
    """Headless: stage replicas reach each other's data ports directly, pod to pod."""
    group = doc.spec.group(host)
    ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
             for name, port in zmq_ports(doc, len(group))]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(doc, names.stage_name(doc.metadata.name, host),
                             labels(doc, C.COMPONENT_STAGE, host), owner_uid),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector(doc, C.COMPONENT_STAGE, host),
            "ports": ports,
        },
    }


def build_stage_pdb(doc: OmniPipeline, host: str, owner_uid: str | None = None) -> Obj:
    # maxUnavailable 1 lets node drains and the cluster autoscaler proceed one pod at a time.
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": metadata(doc, names.stage_name(doc.metadata.name, host),
                             labels(doc, C.COMPONENT_STAGE, host), owner_uid),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(doc, C.COMPONENT_STAGE, host)}},
    }


def target_quantity(v: float) -> str:
    """A Kubernetes quantity for a target: whole numbers as they are, fractions in milli-units."""
    return str(int(v)) if float(v).is_integer() else f"{round(v * 1000)}m"


def build_stage_hpa(doc: OmniPipeline, host: str, owner_uid: str | None = None) -> Obj:
    group = doc.spec.group(host)
    a = group[0].autoscaling
    assert a is not None
    name = names.stage_name(doc.metadata.name, host)
    target = {"type": "AverageValue", "averageValue": target_quantity(a.target_for(group))}
    if a.min_replicas == 0:
        # No pod to read at zero: the masters' demand for the stage (requests in flight on it or waiting
        # for it), an object metric of the master Service, which the HPA can read at zero replicas.
        metric = {"type": "Object", "object": {
            "describedObject": {"apiVersion": "v1", "kind": "Service", "name": names.master_name(doc.metadata.name)},
            "metric": {"name": C.STAGE_DEMAND_METRIC, "selector": {"matchLabels": {"stage": host}}},
            "target": target}}
    else:
        metric = {"type": "Pods", "pods": {
            "metric": {"name": AUTOSCALING_METRICS[a.metric_for(group)],
                       "selector": {"matchLabels": {"stage": a.metric_stage(group)}}},
            "target": target}}
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(doc, name, labels(doc, C.COMPONENT_STAGE, host), owner_uid),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [metric],
        } | ({"behavior": {"scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds}}}
             if a.scale_down_stabilization_seconds is not None else {}),
    }


def build_network_policy(doc: OmniPipeline, owner_uid: str | None = None) -> Obj:
    """ZMQ ports only from this pipeline's pods; the API, probe and metrics ports from anywhere; the admin
    port only from spec.master.adminSources (no rule, so no source, when it is empty)."""
    p = doc.metadata.name
    max_group = max(len(doc.spec.group(h.name)) for h in doc.spec.hosts())
    internal = [{"protocol": "TCP", "port": C.PORT_NAME_CONTROL}] + [
        {"protocol": "TCP", "port": name} for name, _ in zmq_ports(doc, max_group)]
    sources = [peer.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
               for peer in doc.spec.master.admin_sources]
    admin = [{"from": sources, "ports": [{"protocol": "TCP", "port": C.PORT_NAME_ADMIN}]}] if sources else []
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(doc, names.network_policy_name(p), labels(doc), owner_uid),
        "spec": {
            "podSelector": {"matchLabels": {C.LABEL_PIPELINE: p}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {C.LABEL_PIPELINE: p}}}], "ports": internal},
                {"ports": [{"protocol": "TCP", "port": C.PORT_NAME_HTTP},
                           {"protocol": "TCP", "port": C.PORT_NAME_HEALTH},
                           {"protocol": "TCP", "port": C.PORT_NAME_METRICS}]},
            ] + admin,
        },
    }


def build_keys_secret(doc: OmniPipeline, keys: dict[str, str], owner_uid: str | None = None) -> Obj:
    """The Secret of the pipeline's ZMQ keys; the keys themselves come from the caller (the operator makes them)."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": metadata(doc, names.keys_secret_name(doc.metadata.name), labels(doc), owner_uid),
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(keys.items())},
    }


def secret_data_hash(data: dict[str, str]) -> str:
    """What the pod templates carry of the Secret: a hash of its (base64) data."""
    return stable_hash(data)


def build_egress_policy(doc: OmniPipeline, owner_uid: str | None = None) -> Obj | None:
    """Stage pods connect only to the pipeline's pods and DNS, unless a stage of the pod asks for any."""
    p = doc.metadata.name
    open_hosts = sorted({s.colocate_with or s.name for s in doc.spec.stages if s.egress == "any"})
    if len(open_hosts) == len(doc.spec.hosts()):
        return None
    pods: Obj = {"matchLabels": {C.LABEL_PIPELINE: p, C.LABEL_OF_COMPONENT: C.COMPONENT_STAGE}}
    if open_hosts:
        pods["matchExpressions"] = [{"key": C.LABEL_STAGE, "operator": "NotIn", "values": open_hosts}]
    # DNS: one rule per protocol (the drift check matches list items by port; two items of port 53 would not do).
    dns = [{"ports": [{"protocol": proto, "port": 53}]} for proto in ("UDP", "TCP")]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(doc, names.egress_policy_name(p), labels(doc), owner_uid),
        "spec": {
            "podSelector": pods,
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"podSelector": {"matchLabels": {C.LABEL_PIPELINE: p}}}]},
                *dns,
            ],
        },
    }


def build_pod_monitor(doc: OmniPipeline, owner_uid: str | None = None) -> Obj:
    """Scrape every pod of the pipeline: the master's /metrics on its API port, each stage pod's on `metrics`.

    A PodMonitor, not a ServiceMonitor: the stage Services are headless and carry
    only data ports, and each stage pod is its own target anyway. The master's
    per-replica series name the stage pod in their own `pod` label, so its
    endpoint honors the scraped labels.
    """
    m = doc.spec.monitoring
    assert m is not None
    p = doc.metadata.name
    # Every series gets its pipeline's name (what the dashboard selects by).
    relabel = [{"sourceLabels": [f"__meta_kubernetes_pod_label_{_prom_label(C.LABEL_PIPELINE)}"],
                "targetLabel": "pipeline"}]
    meta = metadata(doc, p, labels(doc) | dict(sorted(m.labels.items())), owner_uid)
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta,
        "spec": {
            "selector": {"matchLabels": {C.LABEL_PIPELINE: p}},
            "podMetricsEndpoints": [
                {"port": C.PORT_NAME_HTTP, "path": "/metrics", "interval": m.interval, "honorLabels": True,
                 "relabelings": relabel},
                {"port": C.PORT_NAME_METRICS, "path": "/metrics", "interval": m.interval, "relabelings": relabel},
            ],
        },
    }


def _prom_label(key: str) -> str:
    """A Kubernetes label key as Prometheus' service discovery spells it."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)


def desired(doc: OmniPipeline, owner_uid: str | None = None, keys_hash: str | None = None) -> list[Obj]:
    """Every child of a valid pipeline, in apply order (not its keys Secret: see build_keys_secret)."""
    objs = [
        build_service_account(doc, owner_uid),
        build_config_map(doc, owner_uid),
        build_network_policy(doc, owner_uid),
        *filter(None, [build_egress_policy(doc, owner_uid)]),
        build_master_deployment(doc, owner_uid, keys_hash),
        build_master_service(doc, owner_uid),
        build_masters_service(doc, owner_uid),
        *filter(None, [build_master_pdb(doc, owner_uid)]),
    ]
    for host in doc.spec.hosts():
        objs += [
            build_stage_deployment(doc, host.name, owner_uid, keys_hash),
            build_stage_service(doc, host.name, owner_uid),
            build_stage_pdb(doc, host.name, owner_uid),
        ]
        if host.autoscaling is not None:
            objs.append(build_stage_hpa(doc, host.name, owner_uid))
    if doc.spec.monitoring is not None and doc.spec.monitoring.pod_monitor:
        objs.append(build_pod_monitor(doc, owner_uid))
    return objs
