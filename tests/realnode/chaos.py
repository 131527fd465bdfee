"""Chaos on real pods: a bounded client load on a pipeline while its pods are deleted at random.

The scenario shared by tests/realnode/test_chaos.py (which asserts on it) and bench/chaos.py
(which runs that test and records its counts). Pieces:

- `ask`: one chat request to the master Service's ClusterIP, straight from this host over the
  dev bridge (kube-proxy's rules route it to whichever master pod is ready: no port-forward,
  which would follow one pod and go through the kubelet), on a new connection each time, and
  its one outcome: `ok` (the exact tokens), a clear error (an HTTP status with a message,
  counted as "<status> <type>"), `refused at connect` (the connection was never made: no
  master pod ready behind the Service, so the request was never accepted), or a failure the
  test forbids: `wrong answer`, `unclear error`, `lost after send` (connected, sent, and the
  connection ended without an answer) or `hung` (no answer within the client's timeout, which
  exceeds the request's deadline).
- `Load`: a few clients in threads, each asking again and again until a fixed time or a
  fixed total count; every request sent is counted once, with exactly one outcome.
- `Killer`: every PERIOD_S, one pod picked by a seeded random generator among the pipeline's
  master, its stage pods and the operator's pods, deleted as `kubectl delete pod` does
  (gracefully: its drain runs), the pick logged.
- `wait_recovered`: until everything is back (how long it took is recorded, not judged), checked
  from the last kill on while the load still runs.
"""

from __future__ import annotations

import collections
import datetime as dt
import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from omnifleet_operator.devcluster import commands as dev
from omnifleet_operator.devcluster import net
from omnifleet_operator.leader import LEASE_NAME, LEASE_S
from omnifleet_runtime import constants as C

from ..e2e.kube import Kube, WaitTimeout, is_ready

OK = "ok"
REFUSED = "refused at connect"
# Outcomes the test forbids.
WRONG, UNCLEAR, LOST, HUNG = "wrong answer", "unclear error", "lost after send", "hung"
FORBIDDEN = (WRONG, UNCLEAR, LOST, HUNG)

DEADLINE_S = 60.0  # the request's own deadline (`timeout`): past it the master answers 504
CLIENT_TIMEOUT_S = DEADLINE_S + 30  # a request still unanswered by then is hung
CONNECT_TIMEOUT_S = 10.0
PAUSE_AFTER_FAILURE_S = 1.0  # a client does not spin on a pipeline that answers errors at once
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"


@dataclass
class Outcome:
    kind: str
    started: float  # seconds since the load started
    seconds: float
    detail: str = ""


def master_address(kube: Kube, namespace: str, pipeline: str) -> tuple[str, int]:
    svc = kube.get("Service", namespace, f"{pipeline}-master")
    assert svc, f"no Service {namespace}/{pipeline}-master"
    (port,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] == C.PORT_NAME_HTTP]
    return svc["spec"]["clusterIP"], port


def chat_body(model: str, messages: list[dict]) -> dict:
    return {"model": model, "messages": messages, "return_token_ids": True, "timeout": DEADLINE_S}


def classify(status: int, raw: bytes, text: str, ids: list[int]) -> tuple[str, str]:
    """(kind, detail) of an HTTP answer: exact, a clear error, or neither."""
    try:
        body = json.loads(raw)
    except ValueError:
        return (WRONG if status == 200 else UNCLEAR), f"{status}: {raw[:300]!r}"
    if status == 200:
        try:
            choice = body["choices"][0]
            exact = choice["message"]["content"] == text and choice["token_ids"] == ids
        except (KeyError, IndexError, TypeError):
            exact = False
        return (OK, "") if exact else (WRONG, json.dumps(body)[:500])
    error = body.get("error") if isinstance(body, dict) else None
    if 400 <= status < 600 and isinstance(error, dict) and str(error.get("message") or "").strip():
        return f"{status} {error.get('type') or 'error'}", str(error["message"])[:300]
    return UNCLEAR, f"{status}: {json.dumps(body)[:300]}"


def ask(address: tuple[str, int], body: dict, text: str, ids: list[int], t0: float) -> Outcome:
    """One request on a new connection from the node's own address (so the answer comes back over
    the bridge), and its one outcome."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(*address, timeout=CONNECT_TIMEOUT_S, source_address=(net.NODE_IP, 0))

    def done(kind: str, detail: str = "") -> Outcome:
        return Outcome(kind, started - t0, time.monotonic() - started, detail)

    try:
        try:
            conn.connect()
        except OSError as e:
            return done(REFUSED, f"{type(e).__name__}: {e}")
        conn.sock.settimeout(CLIENT_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", "Connection": "close"})
            resp = conn.getresponse()
            raw = resp.read()
        except (TimeoutError, socket.timeout) as e:
            return done(HUNG, f"no answer within {CLIENT_TIMEOUT_S:g}s: {e}")
        except (OSError, http.client.HTTPException) as e:
            return done(LOST, f"{type(e).__name__}: {e}")
        return done(*classify(resp.status, raw, text, ids))
    finally:
        conn.close()


@dataclass
class Load:
    """`clients` threads asking until `seconds` have passed or `max_requests` were sent in all."""

    send: Callable[[float], Outcome]  # t0 -> the outcome of one request
    clients: int = 3
    seconds: float = 150.0
    max_requests: int = 450
    outcomes: list[Outcome] = field(default_factory=list)
    sent: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._first_ok = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0 = 0.0

    def _take(self) -> bool:
        with self._lock:
            if self.sent >= self.max_requests or time.monotonic() - self.t0 >= self.seconds:
                return False
            self.sent += 1
            return True

    def _client(self) -> None:
        while self._take():
            try:
                out = self.send(self.t0)
            except Exception as e:  # a bug of the client itself: still one outcome for the request sent
                out = Outcome(UNCLEAR, time.monotonic() - self.t0, 0.0, f"client error {type(e).__name__}: {e}")
            with self._lock:
                self.outcomes.append(out)
            if out.kind == OK:
                self._first_ok.set()
            else:
                time.sleep(PAUSE_AFTER_FAILURE_S)

    def start(self) -> Load:
        self.t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._client, name=f"chaos-client-{i}", daemon=True)
                         for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def wait_first_ok(self, timeout: float) -> bool:
        return self._first_ok.wait(timeout)

    def join(self) -> None:
        # Each request ends within CLIENT_TIMEOUT_S (+ the connect timeout): a bound, not a guess.
        limit = time.monotonic() + self.seconds + CLIENT_TIMEOUT_S + CONNECT_TIMEOUT_S + 30
        for t in self._threads:
            t.join(max(0.0, limit - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        assert not stuck, f"client threads still running past every request's bound: {stuck}"

    def counts(self) -> dict[str, int]:
        return dict(sorted(collections.Counter(o.kind for o in self.outcomes).items()))


@dataclass
class Kill:
    at: float  # seconds since the load started
    component: str  # master | <stage> | operator
    pod: str


class Killer:
    """Every `period` seconds for `duration`, delete one random pod (seeded; each pick logged)."""

    def __init__(self, cluster, kube: Kube, namespace: str, pipeline: str, stages: list[str], seed: int,
                 period: float = 10.0, duration: float = 120.0, log: Callable[[str], None] = print):
        self.cluster, self.kube, self.ns, self.pipeline = cluster, kube, namespace, pipeline
        self.components = ["master", *stages, "operator"]
        self.rng = random.Random(seed)
        self.seed, self.period, self.duration, self.log = seed, period, duration, log
        self.kills: list[Kill] = []
        self.last_kill_at: float | None = None  # monotonic

    def live_pods(self, component: str) -> list[str]:
        if component == "operator":
            ns, selector = dev.OPERATOR_NAMESPACE, OPERATOR_SELECTOR
        elif component == "master":
            ns, selector = self.ns, f"omnifleet.dev/pipeline={self.pipeline},omnifleet.dev/component=master"
        else:
            ns, selector = self.ns, f"omnifleet.dev/pipeline={self.pipeline},omnifleet.dev/stage={component}"
        return sorted(p["metadata"]["name"] for p in self.kube.list("Pod", ns, selector)
                      if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") != "Succeeded")

    def kill_one(self, t0: float) -> Kill | None:
        """Pick a component, then one of its live pods (a component with none is skipped: its pod is
        already being replaced); delete it gracefully, as `kubectl delete pod` does."""
        for component in self.rng.sample(self.components, len(self.components)):
            pods = self.live_pods(component)
            if pods:
                break
        else:
            self.log("no live pod to delete")
            return None
        pod = self.rng.choice(pods)
        ns = dev.OPERATOR_NAMESPACE if component == "operator" else self.ns
        self.cluster.kubectl("delete", "pod", "-n", ns, pod, "--wait=false")
        self.last_kill_at = time.monotonic()
        kill = Kill(round(self.last_kill_at - t0, 1), component, pod)
        self.kills.append(kill)
        self.log(f"chaos (seed {self.seed}) t={kill.at:.0f}s: deleted {component} pod {ns}/{pod}")
        return kill

    def run(self, t0: float) -> None:
        """Kills at period, 2*period, ... up to duration from now (`t0`: the load's start, for the log)."""
        begin = time.monotonic()
        for i in range(1, int(self.duration // self.period) + 1):
            time.sleep(max(0.0, begin + i * self.period - time.monotonic()))
            self.kill_one(t0)


def master_ready(address: tuple[str, int]) -> bool:
    """The master's /ready: 200 only with every stage registered and it not draining."""
    conn = http.client.HTTPConnection(*address, timeout=5, source_address=(net.NODE_IP, 0))
    try:
        conn.request("GET", "/ready", headers={"Connection": "close"})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def missing(kube: Kube, namespace: str, pipeline: str, address: tuple[str, int],
            terminating: dict[str, str]) -> dict[str, str]:
    """Each part not back yet, with what is missing (empty: all is back): the pipeline Ready, each of its
    Deployments and the operator's with every wanted replica ready, no pod terminating (`terminating`:
    terminating_pods' answer), the master answering /ready, and an operator replica leading (its Lease
    renewed within the Lease's duration)."""
    out: dict[str, str] = {}
    doc = kube.pipeline(namespace, pipeline)
    if not doc or not is_ready(doc):
        st = (doc or {}).get("status") or {}
        out["pipeline Ready"] = (f"pipeline not Ready (generation {(doc or {}).get('metadata', {}).get('generation')}, "
                                 f"observed {st.get('observedGeneration')}): {st.get('message')}")
    deployments = kube.list("Deployment", namespace, f"omnifleet.dev/pipeline={pipeline}")
    deployments += [d for d in kube.list("Deployment", dev.OPERATOR_NAMESPACE) if d["metadata"]["name"] ==
                    dev.OPERATOR_SA]
    for d in deployments:
        want, st = d["spec"].get("replicas", 1), d.get("status") or {}
        if st.get("readyReplicas", 0) != want or st.get("updatedReplicas", 0) != want:
            out[f"deployment {d['metadata']['name']}"] = (f"deployment {d['metadata']['name']}: "
                                                          f"{st.get('readyReplicas', 0)}/{want} ready")
    if terminating:
        out["no pod terminating"] = f"pods still terminating: {sorted(terminating)}"
    if not master_ready(address):
        out["master /ready"] = "the master's /ready is not 200"
    spec = (kube.get("Lease", dev.OPERATOR_NAMESPACE, LEASE_NAME) or {}).get("spec") or {}
    renewed = spec.get("renewTime")
    age = (dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(renewed.replace("Z", "+00:00"))
           ).total_seconds() if renewed else None
    if age is None or age > spec.get("leaseDurationSeconds", LEASE_S):
        out["operator Lease"] = (f"no operator replica leads: {LEASE_NAME} held by {spec.get('holderIdentity')!r}, "
                                 f"renewed {renewed}")
    return out


def terminating_pods(kube: Kube, namespace: str, pipeline: str) -> dict[str, str]:
    """The pipeline's and the operator's pods being deleted: name -> namespace."""
    pods = kube.list("Pod", namespace, f"omnifleet.dev/pipeline={pipeline}")
    pods += kube.list("Pod", dev.OPERATOR_NAMESPACE, OPERATOR_SELECTOR)
    return {p["metadata"]["name"]: p["metadata"]["namespace"] for p in pods if p["metadata"].get("deletionTimestamp")}


# A pod terminating this long drained in-flight work for a while (this load's requests take a few seconds),
# or is stuck in its shutdown: the end of its log, read while it still exists, says which and where.
LINGER_S = 15.0
LINGER_LOG_LINES = 30


@dataclass
class Recovery:
    seconds: float  # from `since` until every part was back
    first_check_s: float  # from `since` to the first check (parts back by then have no time of their own)
    back_s: dict[str, float]  # each part missing at some check: when it was seen back, from `since`
    # Each pod seen terminating: the first and last check that saw it so, from `since`.
    terminating_s: dict[str, list[float]] = field(default_factory=dict)
    # Each pod seen terminating over LINGER_S: how long it was seen terminating, and the end of its log.
    lingering: dict[str, dict[str, Any]] = field(default_factory=dict)


def wait_recovered(kube: Kube, namespace: str, pipeline: str, address: tuple[str, int], since: float,
                   timeout: float) -> Recovery:
    """Until every part of `missing` is back, checked every second: when each part came back (what came back
    last is what recovery waited for); fails after `timeout` naming what is missing."""
    deadline = time.monotonic() + timeout
    first = time.monotonic() - since
    back: dict[str, float] = {}
    away: set[str] = set()
    seen_terminating: dict[str, list[float]] = {}
    lingering: dict[str, dict[str, Any]] = {}
    while True:
        terminating = terminating_pods(kube, namespace, pipeline)
        gone = missing(kube, namespace, pipeline, address, terminating)
        now = time.monotonic() - since
        for part in away - set(gone):
            back[part] = round(now, 1)
        away = set(gone)
        for pod, ns in terminating.items():
            seen = seen_terminating.setdefault(pod, [round(now, 1), 0.0])
            seen[1] = round(now, 1)
            for_s = now - seen[0]
            if for_s > LINGER_S:  # read again at each check: the last read holds what it logged last
                logs = kube.kubectl("logs", "-n", ns, pod, "--all-containers", f"--tail={LINGER_LOG_LINES}",
                                    check=False)
                lingering[pod] = {"terminating_seen_s": round(for_s, 1),
                                  "log_tail": (logs.stdout or logs.stderr or "").splitlines()[-LINGER_LOG_LINES:]}
        if not gone:
            return Recovery(now, round(first, 1), back, seen_terminating, lingering)
        assert time.monotonic() < deadline, (f"not recovered {timeout:.0f}s after the last kill: "
                                             f"{'; '.join(gone.values())}\n{operator_state(kube)}")
        time.sleep(1.0)


def wait_ready(kube: Kube, namespace: str, pipeline: str, timeout: float, generation: int | None = None) -> dict:
    """Kube.wait_ready, failing with the operator's state."""
    try:
        return kube.wait_ready(namespace, pipeline, timeout=timeout, generation=generation)
    except WaitTimeout as e:
        raise WaitTimeout(f"{e}\n{operator_state(kube)}") from None


def operator_state(kube: Kube, tail: int = 15) -> str:
    """Who holds the operator's Lease, and each operator pod with the end of its log: what a failure
    to reconcile is read from."""
    lease = kube.get("Lease", dev.OPERATOR_NAMESPACE, LEASE_NAME) or {}
    spec = lease.get("spec") or {}
    lines = [f"operator lease: holder {spec.get('holderIdentity')!r}, renewed {spec.get('renewTime')}"]
    for pod in kube.list("Pod", dev.OPERATOR_NAMESPACE, OPERATOR_SELECTOR):
        name, statuses = pod["metadata"]["name"], pod["status"].get("containerStatuses") or []
        lines.append(f"operator pod {name}: {pod['status'].get('phase')}, ready "
                     f"{[s.get('ready') for s in statuses]}, restarts {[s.get('restartCount') for s in statuses]}")
        logs = kube.kubectl("logs", "-n", dev.OPERATOR_NAMESPACE, name, f"--tail={tail}", check=False)
        lines += ["  " + line for line in (logs.stdout or logs.stderr or "").splitlines()[-tail:]]
    return "\n".join(lines)


def report(load: Load, kills: list[Kill], recovery: Recovery, **extra: Any) -> dict[str, Any]:
    """The counts a run is judged and recorded by."""
    errors = {k: v for k, v in load.counts().items() if k not in (OK, REFUSED)}
    first = {}
    for o in load.outcomes:  # one example message per kind of failure
        if o.kind != OK and o.kind not in first:
            first[o.kind] = o.detail
    return {
        "sent": load.sent, "answered": len(load.outcomes), "succeeded": load.counts().get(OK, 0),
        "refused_at_connect": load.counts().get(REFUSED, 0), "errors": errors, "examples": first,
        "clients": load.clients, "load_seconds": load.seconds, "max_requests": load.max_requests,
        "request_deadline_s": DEADLINE_S, "client_timeout_s": CLIENT_TIMEOUT_S,
        "longest_request_s": round(max((o.seconds for o in load.outcomes), default=0.0), 1),
        "kills": [vars(k) for k in kills], "seconds_from_last_kill_to_recovered": round(recovery.seconds, 1),
        "first_check_s": recovery.first_check_s, "parts_back_s": recovery.back_s,
        "terminating_seen_s": recovery.terminating_s, "lingering_pods": recovery.lingering,
        **extra,
    }
