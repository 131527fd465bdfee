"""Helpers of the end-to-end suite: bounded polling, a small REST reader, pipelines.

Reads go straight to the API server over HTTPS with the admin token (cheap
enough to poll several times a second on 2 cores); changes go through kubectl,
the way a user makes them.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from omnifleet_operator.devcluster import commands as dev
from omnifleet_operator.devcluster.cluster import DevCluster
from omnifleet_runtime.lifetime import parent_death_preexec

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
SAMPLE_FILES = sorted(p for p in SAMPLES.glob("*.yaml") if p.name != "kustomization.yaml")

LABEL_PIPELINE = "omnifleet.dev/pipeline"
OPERATOR_USER = dev.OPERATOR_USER
RESYNC_S = 3.0  # the operator's OMNIFLEET_RESYNC_SECONDS in this suite
WATCH_TIMEOUT_S = 20  # its OMNIFLEET_WATCH_TIMEOUT
TIMEOUT_S = 60.0  # default bound of every wait

T = TypeVar("T")

# kind -> (API prefix, plural, namespaced)
RESOURCES = {
    "OmniPipeline": ("/apis/omnifleet.dev/v1alpha1", "omnipipelines", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "Service": ("/api/v1", "services", True),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims", True),
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "ReplicaSet": ("/apis/apps/v1", "replicasets", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases", True),
}
# What the operator renders (the kinds `omnifleet render` prints).
CHILD_KINDS = ("ServiceAccount", "ConfigMap", "NetworkPolicy", "Deployment", "Service",
               "PodDisruptionBudget", "HorizontalPodAutoscaler")
# Everything that carries a pipeline's label, children of children included.
LABELLED_KINDS = CHILD_KINDS + ("ReplicaSet", "Pod", "EndpointSlice")


class WaitTimeout(AssertionError):
    pass


def wait_for(predicate: Callable[[], T], timeout: float = TIMEOUT_S, what: str | Callable[[], str] = "condition",
             interval: float = 0.25) -> T:
    """Call `predicate` until it returns something truthy (returned); bounded by `timeout` seconds.

    `what` names the wait in the failure message; a callable is asked only then (the state at timeout).
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            desc = what() if callable(what) else what
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {desc}; last value: {last!r}"[:4000])
        time.sleep(interval)


def idle_period(periods: float, why: str) -> float:
    """The one kind of fixed wait: proving that something does NOT happen over `periods` resyncs."""
    seconds = periods * RESYNC_S + 1.0
    print(f"waiting {seconds:.0f}s ({periods} resync periods of {RESYNC_S:.0f}s): {why}")
    time.sleep(seconds)
    return seconds


class Kube:
    """Read-only REST access with the admin token, plus kubectl for changes."""

    def __init__(self, cluster: DevCluster):
        self.cluster = cluster
        self.base = cluster.apiserver_url
        self._auth = {"Authorization": f"Bearer {cluster.admin_token}"}
        self._ctx = ssl.create_default_context(cafile=str(cluster.ca_file))

    # -- REST reads -------------------------------------------------------------

    def _path(self, kind: str, namespace: str | None, name: str | None = None) -> str:
        prefix, plural, namespaced = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced and namespace else f"{prefix}/{plural}"
        return f"{path}/{name}" if name else path

    def request(self, path: str, params: dict | None = None) -> dict | None:
        url = self.base + path + (("?" + urllib.parse.urlencode(params)) if params else "")
        req = urllib.request.Request(url, headers=self._auth)
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=20) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self.request(self._path(kind, namespace, name))

    def list(self, kind: str, namespace: str | None = None, selector: str | None = None,
             fields: str | None = None) -> list[dict]:
        params = {}
        if selector:
            params["labelSelector"] = selector
        if fields:
            params["fieldSelector"] = fields
        got = self.request(self._path(kind, namespace), params) or {}
        items = got.get("items") or []
        for i in items:  # lists leave kind/apiVersion out of their items
            i.setdefault("kind", kind)
        return items

    # -- kubectl ------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return self.cluster.kubectl(*args, input=input, check=check, timeout=timeout)

    def apply(self, obj: dict | list[dict], namespace: str | None = None) -> None:
        objs = obj if isinstance(obj, list) else [obj]
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
        self.kubectl("apply", *(["-n", namespace] if namespace else []), "-f", "-", input=doc)

    def patch_json(self, kind: str, namespace: str, name: str, ops: list[dict]) -> None:
        self.kubectl("patch", kind, name, "-n", namespace, "--type=json", "-p", json.dumps(ops))

    # -- pipelines ------------------------------------------------------------------

    def pipeline(self, namespace: str, name: str) -> dict | None:
        return self.get("OmniPipeline", namespace, name)

    def children(self, namespace: str, pipeline: str, kinds=CHILD_KINDS) -> list[dict]:
        out = []
        for kind in kinds:
            out += self.list(kind, namespace, f"{LABEL_PIPELINE}={pipeline}")
        return out

    def events(self, namespace: str, uid: str) -> list[dict]:
        return [e for e in self.list("Event", namespace) if e["involvedObject"].get("uid") == uid]

    def wait_ready(self, namespace: str, name: str, timeout: float = TIMEOUT_S, generation: int | None = None) -> dict:
        def ready():
            p = self.pipeline(namespace, name)
            if p and is_ready(p) and (generation is None or p["metadata"]["generation"] == generation):
                return p
            return None

        return wait_for(ready, timeout, lambda: f"{namespace}/{name} Ready"
                        + (f" at generation {generation}" if generation else "")
                        + f" (status now: {self._summary(namespace, name)})")

    def wait_condition(self, namespace: str, name: str, reason: str, timeout: float = TIMEOUT_S) -> dict:
        """Until the (current-generation) Ready condition has `reason`."""
        def has():
            p = self.pipeline(namespace, name)
            if p and observed(p) and (condition(p, "Ready") or {}).get("reason") == reason:
                return p
            return None

        return wait_for(has, timeout, lambda: f"{namespace}/{name} Ready reason {reason} "
                        f"(status now: {self._summary(namespace, name)})")

    def _summary(self, namespace: str, name: str) -> str:
        p = self.pipeline(namespace, name)
        st = (p or {}).get("status") or {}
        return (f"generation={(p or {}).get('metadata', {}).get('generation')} "
                f"observedGeneration={st.get('observedGeneration')} phase={st.get('phase')} "
                f"message={st.get('message')!r}")

    def pods_by_component(self, namespace: str, pipeline: str) -> dict[str, dict[str, str]]:
        """{'master' | stage: {pod name: uid}} of the live (not terminating) pods."""
        out: dict[str, dict[str, str]] = {}
        for pod in self.list("Pod", namespace, f"{LABEL_PIPELINE}={pipeline}"):
            if pod["metadata"].get("deletionTimestamp"):
                continue
            labels = pod["metadata"]["labels"]
            key = labels.get("omnifleet.dev/stage") or labels.get("omnifleet.dev/component")
            out.setdefault(key, {})[pod["metadata"]["name"]] = pod["metadata"]["uid"]
        return out


# -- pipeline documents and status ------------------------------------------------------

def load_sample(name: str) -> dict:
    return yaml.safe_load((SAMPLES / name).read_text())


def pipeline_doc(name: str, stages: list[dict], **spec: Any) -> dict:
    return {"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": name}, "spec": {"model": "test/model", **spec, "stages": stages}}


def with_namespace(doc: dict, namespace: str) -> dict:
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = namespace
    return doc


def condition(obj: dict, ctype: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def observed(obj: dict) -> bool:
    return (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]


def is_ready(obj: dict) -> bool:
    ready = condition(obj, "Ready") or {}
    gen = obj["metadata"]["generation"]
    return observed(obj) and ready.get("status") == "True" and ready.get("observedGeneration") == gen


def render(doc: dict, namespace: str) -> list[dict]:
    """What `omnifleet render` prints for a pipeline document in a namespace."""
    proc = subprocess.run([sys.executable, "-m", "omnifleet_operator.cli", "render", "-f", "-", "-n", namespace],
                          input=yaml.safe_dump(doc), capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def key_of(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def operator_writes(cluster: DevCluster, since_line: int, namespace: str | None = None) -> list[dict]:
    """Write requests the operator made since an audit-log line, optionally in one namespace."""
    out = cluster.writes(user=OPERATOR_USER, since_line=since_line)
    if namespace is not None:
        out = [w for w in out if (w.get("objectRef") or {}).get("namespace") == namespace]
    return out


def describe_writes(writes: list[dict]) -> list[str]:
    out = []
    for w in writes:
        ref = w.get("objectRef") or {}
        res = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        out.append(f"{w.get('verb')} {res} {ref.get('namespace')}/{ref.get('name')} "
                   f"-> {(w.get('responseStatus') or {}).get('code')}")
    return out


# -- the operator as a subprocess ----------------------------------------------------------

class OperatorRunner:
    """The real operator (`python -m omnifleet_operator.cli operator`) as the ServiceAccount."""

    def __init__(self, cluster: DevCluster, log: Path, args: tuple[str, ...] = ()):
        self.cluster = cluster
        self.log = log
        self.args = args  # more `omnifleet operator` flags
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        kubeconfig = self.cluster.sa_kubeconfig(dev.OPERATOR_NAMESPACE, dev.OPERATOR_SA)
        url = f"http://127.0.0.1:{dev.free_port()}/healthz"
        env = dev.operator_env(kubeconfig, resync_seconds=RESYNC_S, watch_timeout=WATCH_TIMEOUT_S)
        with self.log.open("ab") as log:
            log.write(f"===== operator start #{self.starts + 1} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(dev.operator_argv(url, list(self.args)), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
                                         preexec_fn=parent_death_preexec(signal.SIGTERM))
        self.starts += 1
        dev.wait_live(url, self.alive, self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up, as a crash or an OOM kill would."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"


class Watch:
    """`kubectl get KIND NAME -w -o json` in the background; `.objects` in arrival order."""

    def __init__(self, kube: Kube, kind: str, namespace: str, name: str):
        c = kube.cluster
        argv = [c._bin("kubectl"), f"--kubeconfig={c.kubeconfig}", f"--cache-dir={c.state_dir / 'kubectl-cache'}",
                "get", kind, name, "-n", namespace, "-w", "-o", "json"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.objects: list[dict] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = json.JSONDecoder()
        buf = ""
        for line in self.proc.stdout:
            buf += line
            while True:
                stripped = buf.lstrip()
                if not stripped:
                    buf = ""
                    break
                try:
                    obj, end = decoder.raw_decode(stripped)
                except ValueError:
                    break  # incomplete: read more
                self.objects.append(obj)
                buf = stripped[end:]

    def stop(self) -> list[dict]:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._thread.join(timeout=10)
        return list(self.objects)


def weights(kube: Kube, namespace: str, claim: str = "omni-weights") -> None:
    """The claim a sample's modelVolume names, bound to a static PV."""
    kube.apply(dev.weights_volume(namespace, claim))

    def bound() -> bool:
        pvc = kube.get("PersistentVolumeClaim", namespace, claim) or {}
        return pvc.get("status", {}).get("phase") == "Bound"

    wait_for(bound, 60, f"PVC {namespace}/{claim} Bound")


def wait_namespaces_gone(kube: Kube, timeout: float = 120) -> None:
    """Until no namespace is Terminating (earlier tests' clean-up has finished)."""
    def terminating() -> list[str]:
        return [n["metadata"]["name"] for n in kube.list("Namespace")
                if n.get("status", {}).get("phase") == "Terminating"]

    wait_for(lambda: not terminating(), timeout, lambda: f"no Terminating namespaces (now: {terminating()})")
