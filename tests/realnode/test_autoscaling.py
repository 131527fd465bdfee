"""An autoscaled stage on real pods, scaled by the HPA controller and nothing else.

The HPA reads `omnifleet_worker_inflight` through the aggregation layer from the operator's
custom.metrics.k8s.io server (manifests/autoscaling/, applied by `dev up`), which reads the stage pods'
`metrics` ports. A bounded load (LOAD_CLIENTS clients, at most LOAD_MAX_REQUESTS requests and
LOAD_MAX_S seconds) raises the stage's in-flight count over its target: the HPA adds a replica; the
load ends: the HPA takes it away. The operator writes no replica count meanwhile, and the pipeline
file shows no drift to a GitOps tool (`kubectl diff`). A stage with minReplicas 0 goes to zero when idle
and comes back for a request, which the master holds meanwhile.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from omnifleet_operator.devcluster import commands as dev
from omnifleet_runtime import constants as C

from ..e2e.kube import wait_for
from .conftest import PSA_RESTRICTED, describe_failure, make_namespace, wait_ready

NAME = "held"
STAGE = "hold"
HOLD_S = 3.0  # each request stays this long in the stage: in flight, as an LLM's decode would be
CODE = f'''"""A stage that holds each request {HOLD_S:g} s without using a core."""
import asyncio


async def hold(inputs, sampling_params, context):
    await asyncio.sleep({HOLD_S})
    return "held"
'''
TARGET = 2  # in-flight requests per replica
LOAD_CLIENTS = 6  # 6 in flight on one replica: the HPA wants 3, capped at maxReplicas 2
LOAD_MAX_REQUESTS = 400
LOAD_MAX_S = 240.0
SCALE_TIMEOUT_S = 200.0
OPERATOR_SA_USER = f"system:serviceaccount:{dev.OPERATOR_NAMESPACE}:{dev.OPERATOR_SA}"
INFLIGHT = "omnifleet_worker_inflight"



def pipeline_doc(name: str, autoscaling: dict) -> dict:
    return {
        "apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": name},
        "spec": {
            "master": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
            "stages": [{
                "name": STAGE, "type": "python", "entrypoint": "holdops:hold", "gpus": 0, "finalOutput": "text",
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                "volumes": [{"name": "code", "configMap": {"name": "hold-code"}}],
                "volumeMounts": [{"name": "code", "mountPath": "/opt/code", "readOnly": True}],
                "env": [{"name": "PYTHONPATH", "value": "/opt/code"}],
                "autoscaling": autoscaling,
            }],
        },
    }


class Load:
    """LOAD_CLIENTS threads asking until stopped, LOAD_MAX_REQUESTS were sent, or LOAD_MAX_S passed."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.sent = 0
        self.answers: dict[str, int] = {}
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + LOAD_MAX_S
        self.pool = cf.ThreadPoolExecutor(LOAD_CLIENTS)
        self.futures = [self.pool.submit(self._client) for _ in range(LOAD_CLIENTS)]

    def _client(self) -> None:
        body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hold this"}]}).encode()
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            with self.lock:
                if self.sent >= LOAD_MAX_REQUESTS:
                    return
                self.sent += 1
            req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    outcome = json.loads(r.read())["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as e:
                outcome = f"HTTP {e.code}: {e.read()[:200]!r}"
            except OSError as e:
                outcome = f"{type(e).__name__}: {e}"
            with self.lock:
                self.answers[outcome] = self.answers.get(outcome, 0) + 1

    def finish(self) -> dict[str, int]:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=90)
        self.pool.shutdown()
        return dict(self.answers)


def custom_metric(cluster, ns: str, objects: str = "pods/*", metric: str = INFLIGHT) -> list[dict]:
    """What the HPA controller reads: the aggregation layer's answer for this stage's pods (or an object)."""
    sel = f"{C.LABEL_PIPELINE}={NAME},{C.LABEL_STAGE}={STAGE}"
    r = cluster.kubectl("get", "--raw", f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{ns}/{objects}/{metric}"
                        f"?labelSelector={urllib.request.quote(sel)}&metricLabelSelector=stage%3D{STAGE}", check=False)
    if r.returncode:
        print(f"custom.metrics.k8s.io: {r.stderr.strip()}", flush=True)
        return []
    return json.loads(r.stdout)["items"]


def milli(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


@contextlib.contextmanager
def deployed(cluster, kube, tmp_path: Path, name: str, autoscaling: dict):
    ns = make_namespace(cluster, name, PSA_RESTRICTED)
    cluster.kubectl("create", "configmap", "hold-code", "-n", ns, f"--from-literal=holdops.py={CODE}")
    file = tmp_path / f"{name}.yaml"
    file.write_text(yaml.safe_dump(pipeline_doc(name, autoscaling)))
    cluster.kubectl("apply", "-n", ns, "-f", str(file))
    try:
        wait_ready(kube, cluster, ns, name, timeout=240)
        yield ns, file
    except BaseException:
        print(describe_failure(cluster, ns))
        raise
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def pipeline(cluster, kube, tmp_path: Path):
    with deployed(cluster, kube, tmp_path, NAME, {"minReplicas": 1, "maxReplicas": 2, "metric": "inflight",
                                                  "target": TARGET, "scaleDownStabilizationSeconds": 15}) as d:
        yield d


def test_load_scales_a_stage_up_through_the_hpa_and_back_down(pipeline, cluster, kube):
    ns, file = pipeline
    deploy = f"{NAME}-{STAGE}"
    items = wait_for(lambda: custom_metric(cluster, ns), timeout=90, interval=2,
                     what="the stage pod's series via the APIService")
    assert [milli(i["value"]) for i in items] == [0.0], items
    audit_from = cluster.audit_lines()

    def state() -> dict:
        hpa = kube.get("HorizontalPodAutoscaler", ns, deploy) or {}
        dep = kube.get("Deployment", ns, deploy) or {}
        return {"hpa_current": hpa.get("status", {}).get("currentReplicas"),
                "hpa_desired": hpa.get("status", {}).get("desiredReplicas"),
                "replicas": dep.get("spec", {}).get("replicas"), "ready": dep.get("status", {}).get("readyReplicas")}

    forward = dev.PortForward(cluster, ns, f"svc/{NAME}-master", C.MASTER_API_PORT)
    load = None
    try:
        started = time.monotonic()
        load = Load(forward.url)
        seen = wait_for(lambda: max((milli(i["value"]) for i in custom_metric(cluster, ns)), default=0) > TARGET,
                        timeout=60, interval=2, what=f"{INFLIGHT} over the target under load")
        assert seen
        wait_for(lambda: state()["ready"] == 2 and state()["replicas"] == 2, timeout=SCALE_TIMEOUT_S, interval=1,
                 what=lambda: f"the HPA's second replica serving ({state()})")
        up_s = time.monotonic() - started
        # Both replicas now take requests: each holds some of the load.
        per_pod = wait_for(lambda: (v := [milli(i["value"]) for i in custom_metric(cluster, ns)]) and len(v) == 2
                           and all(x > 0 for x in v) and v, timeout=60, interval=2,
                           what="in-flight requests on both replicas")
        answers = load.finish()
        load = None
        load_s = time.monotonic() - started
        print(f"load to a second replica serving: {up_s:.1f}s; per-pod in flight then {per_pod}; "
              f"answers {answers}", flush=True)
        assert answers == {"held": sum(answers.values())}, answers

        ended = time.monotonic()
        wait_for(lambda: state()["replicas"] == 1 and state()["hpa_current"] == 1, timeout=SCALE_TIMEOUT_S,
                 interval=2, what=lambda: f"the HPA back at one replica ({state()})")
        print(f"load ended to one replica: {time.monotonic() - ended:.1f}s (stabilization 15 s); "
              f"load ran {load_s:.0f}s", flush=True)
    finally:
        if load is not None:
            load.finish()
        forward.stop()

    # The replica count moved only through the scale subresource, by the HPA controller.
    writes = [w for w in cluster.writes(since_line=audit_from)
              if (w.get("objectRef") or {}).get("namespace") == ns
              and (w.get("objectRef") or {}).get("resource") == "deployments"
              and (w.get("objectRef") or {}).get("name") == deploy]
    scales = [w for w in writes if (w["objectRef"].get("subresource") == "scale")]
    assert len(scales) >= 2 and all(w["userAgent"].endswith("horizontal-pod-autoscaler") for w in scales), \
        [(w["verb"], w["userAgent"]) for w in scales]
    assert not [w for w in writes if w["user"]["username"] == OPERATOR_SA_USER
                and w["objectRef"].get("subresource") == "scale"]
    dep = kube.get("Deployment", ns, deploy)
    operator_fields = [m for m in dep["metadata"]["managedFields"] if m["manager"] == C.FIELD_MANAGER]
    assert operator_fields and all("f:replicas" not in json.dumps(m.get("fieldsV1", {}).get("f:spec", {}))
                                   for m in operator_fields), operator_fields
    # What Argo CD or Flux compares: the pipeline file against the live object.
    diff = cluster.kubectl("diff", "-n", ns, "-f", str(file), check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def test_a_stage_scaled_to_zero_wakes_for_a_request_that_waits(cluster, kube, tmp_path: Path):
    """minReplicas 0: idle, the HPA takes the last replica away (on the masters' demand, an object metric of
    the master Service); a request then waits in the master while the HPA starts one, and is answered."""
    name = "idle"
    auto = {"minReplicas": 0, "maxReplicas": 1, "activationTimeoutSeconds": 240, "scaleDownStabilizationSeconds": 15}
    with deployed(cluster, kube, tmp_path, name, auto) as (ns, _):
        deploy = f"{name}-{STAGE}"

        def replicas() -> tuple:
            dep = kube.get("Deployment", ns, deploy) or {}
            return dep.get("spec", {}).get("replicas"), dep.get("status", {}).get("readyReplicas") or 0

        wait_for(lambda: replicas() == (0, 0), timeout=SCALE_TIMEOUT_S, interval=2,
                 what=lambda: f"the idle stage scaled to zero by its HPA ({replicas()})")
        ready = wait_ready(kube, cluster, ns, name, timeout=60)
        assert "scaled to zero" in condition_message(ready, "Ready"), ready["status"]
        demand = custom_metric(cluster, ns, f"services/{name}-master", C.STAGE_DEMAND_METRIC)
        assert [(i["describedObject"]["kind"], milli(i["value"])) for i in demand] == [("Service", 0.0)], demand

        forward = dev.PortForward(cluster, ns, f"svc/{name}-master", C.MASTER_API_PORT)
        try:
            body = json.dumps({"model": name, "messages": [{"role": "user", "content": "wake up"}]}).encode()
            req = urllib.request.Request(f"{forward.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            started = time.monotonic()
            with urllib.request.urlopen(req, timeout=300) as r:
                answer = json.loads(r.read())["choices"][0]["message"]["content"]
            waited = time.monotonic() - started
        finally:
            forward.stop()
        assert answer == "held"
        assert replicas()[0] == 1  # the HPA's replica (its pod turns ready at its next readiness probe)
        print(f"a request at zero replicas answered after {waited:.1f}s (the stage holds it {HOLD_S:g}s)", flush=True)


def condition_message(pipeline: dict, ctype: str) -> str:
    return next((c.get("message", "") for c in pipeline.get("status", {}).get("conditions", [])
                 if c["type"] == ctype and c["status"] == "True"), "")
