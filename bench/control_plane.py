"""Control-plane benchmark: how the operator scales with the number of pipelines, against the limit.

    .venv/bin/python -m bench.control_plane [--sizes 10,100,500,1000] [--quick] [--profile]

For each N, on a fresh DevCluster (own tmp state dir; N/10+2 kwok nodes with 64 GPUs and room
for 500 pods each; `kubectl apply -k manifests/`, the in-cluster operator scaled to 0) with the
real operator running as the omnifleet-operator ServiceAccount:

- N three-stage pipelines (each stage gpus 1, replicas 1; 14 children each) are server-side
  applied at once by a bench "user" (admin, `--workers` requests in flight). Measured from the
  first of those requests: the time until every child exists (the operator's last 201 in the
  apiserver audit log), until every pipeline is Ready (Ready=True at the current generation,
  seen by a watch), and until every Deployment has its replica ready (the cluster's own floor).
- The operator's write requests per pipeline, from the audit log (user
  system:serviceaccount:omnifleet-system:omnifleet-operator), split into child creates/updates,
  status patches and Events. (apiserver_request_total in Kubernetes 1.36 has no client or user
  label, so only the audit log can attribute writes to a client.)
- The operator's peak RSS (VmHWM) and CPU seconds (utime+stime) from /proc, and the CPU seconds
  of etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, this bench process and
  of everything else on the machine over the same window.
- Idle: the operator's writes (goal: none) and CPU over `--idle-periods` resync periods once all
  is Ready and quiet.

The limit, same N, on a second fresh cluster with no operator: the same pipelines applied the
same way by the same bench user; as each one's uid comes back, its children (the very objects
`render.desired(doc, owner_uid=uid)` gives, rendered before the clock starts) are server-side
applied by a plain bulk client through the operator's own `reconcile.Api.apply` (lightkube
AsyncClient, field manager `omnifleet`, force), authenticated as the same ServiceAccount.
Neither has a client-side rate limit, so "the same rate limit" is the same concurrency:
`--workers` (= the operator's OMNIFLEET_WORKERS) requests in flight. `operator / direct` is the
ratio of the times to all children.

The machine may be shared: each phase also records the CPU the rest of the machine took
("outside load"); N is run in rounds (default 3 at N<=10, 2 at N<=100, else 1; odd rounds
operator first, even rounds direct first) and the headline ratio is the median over the rounds
in which neither phase saw more than 0.15 cores of outside load. `--from-json a.json,b.json`
rebuilds one report from several runs (e.g. an extra round at one N), `--analysis FILE` appends
findings, `--profile` runs the operator under cProfile (bench.cp_operator, all threads).

Everything is bounded: each phase waits at most min(900, 90 + 0.81 N) s (15 min at N=1000) and
reports what it reached; the operator and every cluster process are stopped at the end, also
on errors and Ctrl-C. Results: bench/results/<date>-control-plane.{md,json,*.png}, and the
headline ratios merged into bench/results/latest.json under "control_plane".
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata as md
import json
import os
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from omnifleet_operator.devcluster import build
from omnifleet_operator.devcluster import commands as dev
from omnifleet_operator.devcluster.cluster import COMPONENTS, DevCluster

from . import common
from .cp_direct import (BENCH_FIELD_MANAGER, AuditTail, RawWatch, async_client, audit_time, classify,
                        create_pipelines, describe, direct_apply, namespaces, pipeline_docs, prerender,
                        summarize, with_owner)

OPERATOR_USER = dev.OPERATOR_USER
LABEL_PIPELINE = "omnifleet.dev/pipeline"
GPUS_PER_NODE = 64
PODS_PER_NODE = 500
SETTLE_QUIET_S = 5.0
SETTLE_MAX_S = 60.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def log(msg: str) -> None:
    common.log(msg)


def phase_limit(n: int) -> float:
    return min(900.0, 90.0 + 0.81 * n)


def nodes_for(n: int) -> int:
    return n // 10 + 2


# ---------------------------------------------------------------- /proc


def proc_cpu_s(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        f = common.proc_stat_fields(f"/proc/{pid}/stat")
    except OSError:
        return None
    return (int(f[11]) + int(f[12])) / CLK_TCK


def proc_mem_mib(pid: int | None) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) / 1024
    except (OSError, ValueError, TypeError):
        pass
    return out


def machine_jiffies() -> tuple[int, int]:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class CpuBook:
    """CPU seconds of named processes between two points, plus the machine's and everyone else's."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = {k: v for k, v in pids.items() if v}
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        out = {k: proc_cpu_s(p) or 0.0 for k, p in self.pids.items()}
        out["bench"] = proc_cpu_s(os.getpid()) or 0.0
        busy, total = machine_jiffies()
        out["_machine_busy"] = busy / CLK_TCK
        out["_machine_total"] = total / CLK_TCK
        out["_wall"] = time.time()
        return out

    def delta(self) -> dict[str, float]:
        now = self._read()
        d = {k: round(now[k] - self.start.get(k, 0.0), 2) for k in now}
        ours = sum(v for k, v in d.items() if not k.startswith("_"))
        d["others"] = round(max(0.0, d["_machine_busy"] - ours), 2)
        d["wall_s"] = round(d.pop("_wall"), 2)
        d["machine_busy"] = d.pop("_machine_busy")
        d.pop("_machine_total")
        return d


# ---------------------------------------------------------------- the cluster


def node_manifest(name: str) -> dict[str, Any]:
    # What DevCluster.add_node creates, for many nodes in one request.
    resources = {"cpu": "512", "memory": "4Ti", "pods": str(PODS_PER_NODE), "nvidia.com/gpu": str(GPUS_PER_NODE)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name,
                     "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true"}},
        "spec": {"taints": []},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def start_cluster(state_dir: Path, n: int, ns_count: int) -> DevCluster:
    c = DevCluster(state_dir, timeout=120, owned=True)
    c.up()
    nodes = [node_manifest(f"gpu-{i}") for i in range(nodes_for(n))]
    c.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}),
              timeout=120)
    c.kubectl("wait", "--for=condition=Ready", "nodes", "--all", "--timeout=120s", timeout=130)
    # `kubectl apply -k manifests/` (the documented install), as tests/e2e do; kwok pods run nothing,
    # so the in-cluster operator Deployment is scaled to 0 and the operator runs as a local process.
    c.kubectl("apply", "-k", str(common.ROOT / "manifests"))
    c.kubectl("wait", "--for=condition=Established", "crd/omnipipelines.omnifleet.dev", "--timeout=60s", timeout=70)
    c.kubectl("scale", "deployment", dev.OPERATOR_SA, "-n", dev.OPERATOR_NAMESPACE, "--replicas=0")
    nss = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in namespaces(n, ns_count)]
    c.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nss}))
    return c


def component_pids(c: DevCluster) -> dict[str, int | None]:
    return {name: c._pid(name) for name in COMPONENTS}


class Operator:
    """The real operator as a subprocess (as tests/e2e and `omnifleet dev up` run it), optionally profiled."""

    def __init__(self, c: DevCluster, log_path: Path, workers: int, resync: float, watch_timeout: int,
                 profile_out: Path | None = None, experiment: str = ""):
        self.log = log_path
        self.profile_out = profile_out
        kubeconfig = c.sa_kubeconfig(dev.OPERATOR_NAMESPACE, dev.OPERATOR_SA)
        url = f"http://127.0.0.1:{common.free_port()}/healthz"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
               "OMNIFLEET_RESYNC_SECONDS": f"{resync:g}", "OMNIFLEET_WORKERS": str(workers),
               "OMNIFLEET_WATCH_TIMEOUT": str(watch_timeout)}
        env["PYTHONPATH"] = os.pathsep.join([str(common.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # What `omnifleet dev up` and tests/e2e run: `omnifleet operator --liveness URL`.
        if experiment:
            env["OMNIFLEET_BENCH_EXPERIMENT"] = experiment
        if profile_out is not None or experiment:
            argv = [sys.executable, "-m", "bench.cp_operator", str(profile_out or "-"), "--liveness", url]
        else:
            argv = [sys.executable, "-m", "omnifleet_operator.cli", "operator", "--liveness", url]
        with log_path.open("ab") as f:
            # In the benchmark's session, as the direct client is (a session of its own would be a CPU
            # group of its own where the kernel groups by session: bench.common.Proc says why).
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         env=env, cwd=common.ROOT, process_group=0)
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if not self.alive():
                raise RuntimeError(f"the operator exited during start-up; log {log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the operator's liveness {url} did not answer in 90 s; log {log_path}")
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


# ---------------------------------------------------------------- progress bookkeeping


def is_ready(obj: dict) -> bool:
    st = obj.get("status") or {}
    gen = obj["metadata"].get("generation")
    ready = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), {})
    return (st.get("observedGeneration") == gen and ready.get("status") == "True"
            and ready.get("observedGeneration") == gen)


def deployment_ready(obj: dict) -> bool:
    st = obj.get("status") or {}
    want = (obj.get("spec") or {}).get("replicas", 1)
    return (int(st.get("readyReplicas") or 0) >= want and int(st.get("updatedReplicas") or 0) >= want
            and int(st.get("observedGeneration") or 0) >= obj["metadata"].get("generation", 0))


class Progress:
    """First time each pipeline was Ready, each Deployment had its replicas ready, each child was created."""

    def __init__(self, tail: AuditTail, writer: str):
        self.tail = tail
        self.writer = writer
        self.ready_at: dict[tuple[str, str], float] = {}
        self.dep_ready_at: dict[tuple[str, str], float] = {}
        self.child_created: dict[tuple[str, str, str], float] = {}
        self.writes: dict[str, int] = {}  # the writer's writes so far, by class
        self.mark = tail.mark()
        self._seen = self.mark["events"]
        self.timeline: list[dict[str, Any]] = []

    def on_pipeline(self, etype: str, obj: dict) -> None:
        if etype != "DELETED" and is_ready(obj):
            m = obj["metadata"]
            self.ready_at.setdefault((m["namespace"], m["name"]), time.time())

    def on_deployment(self, etype: str, obj: dict) -> None:
        if etype != "DELETED" and deployment_ready(obj):
            m = obj["metadata"]
            self.dep_ready_at.setdefault((m["namespace"], m["name"]), time.time())

    def poll_audit(self) -> None:
        self.tail.poll()
        for e in self.tail.events[self._seen:]:
            if e["user"]["username"] != self.writer:
                continue
            k = classify(e)
            self.writes[k] = self.writes.get(k, 0) + 1
            if k == "child_create":
                ref = e["objectRef"]
                self.child_created.setdefault((ref["resource"], ref["namespace"], ref["name"]),
                                              audit_time(e["stageTimestamp"]))
        self._seen = len(self.tail.events)


async def sample_loop(prog: Progress, t0: float, op_pid: int | None, stop: asyncio.Event,
                      totals: dict[str, int], label: str, book: "CpuBook | None" = None) -> None:
    last_print = 0.0
    while not stop.is_set():
        prog.poll_audit()
        now = time.time()
        mem = proc_mem_mib(op_pid) if op_pid else {}
        row = {"t": round(now - t0, 2), "children": len(prog.child_created), "ready": len(prog.ready_at),
               "deployments_ready": len(prog.dep_ready_at), "op_rss_mib": round(mem.get("VmRSS", 0), 1),
               "op_cpu_s": proc_cpu_s(op_pid) if op_pid else None, "writes": dict(prog.writes)}
        if book is not None:
            row["cpu"] = book.delta()  # cumulative CPU seconds by process since t0, "others" included
        prog.timeline.append(row)
        if now - last_print >= 10:
            last_print = now
            log(f"  {label} t={row['t']:.0f}s children {row['children']}/{totals['children']} "
                f"deployments ready {row['deployments_ready']}/{totals['deployments']} "
                + (f"pipelines Ready {row['ready']}/{totals['pipelines']} op rss {row['op_rss_mib']:.0f} MiB "
                   f"cpu {row['op_cpu_s']:.1f}s " if op_pid else "")
                + f"load {loadavg()}")
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "max": None}
    return {"p50": round(common.pct(xs, 50), 2), "p90": round(common.pct(xs, 90), 2), "max": round(max(xs), 2)}


# ---------------------------------------------------------------- the two phases


async def operator_phase(n: int, cfg: argparse.Namespace, docs: list[dict], state_dir: Path,
                         per_pipeline: int, idle: bool = True, profile_out: Path | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"n": n, "nodes": nodes_for(n), "children_expected": n * per_pipeline}
    limit = phase_limit(n)
    log(f"[N={n}] operator phase: fresh cluster in {state_dir} ({nodes_for(n)} nodes)")
    c = start_cluster(state_dir, n, cfg.namespaces)
    op = None
    watches: list[asyncio.Task] = []
    try:
        op = Operator(c, state_dir / "logs" / "operator.log", cfg.workers, cfg.resync, cfg.watch_timeout,
                      profile_out, cfg.experiment)
        log(f"[N={n}] operator up (pid {op.pid}{', profiled' if profile_out else ''}); "
            f"workers {cfg.workers}, resync {cfg.resync:g}s")
        tail = AuditTail(c.audit_log, (OPERATOR_USER,))
        await asyncio.sleep(3.0)  # kopf's first lists done; nothing to do yet
        prog = Progress(tail, OPERATOR_USER)
        pw = RawWatch(c, "/apis/omnifleet.dev/v1alpha1/omnipipelines", prog.on_pipeline)
        dw = RawWatch(c, "/apis/apps/v1/deployments", prog.on_deployment, {"labelSelector": LABEL_PIPELINE})
        watches = [asyncio.create_task(pw.run()), asyncio.create_task(dw.run())]
        await asyncio.sleep(1.0)
        op_cpu0 = proc_cpu_s(op.pid)
        rss0 = proc_mem_mib(op.pid)
        book = CpuBook({**component_pids(c), "operator": op.pid})
        if profile_out:
            op.signal(signal.SIGUSR2)  # profile from here on
        admin = async_client(c.kubeconfig, BENCH_FIELD_MANAGER)
        created_at: dict[tuple[str, str], float] = {}

        def on_created(d: dict, uid: str) -> None:
            created_at[(d["metadata"]["namespace"], d["metadata"]["name"])] = time.time()

        stop = asyncio.Event()
        totals = {"children": n * per_pipeline, "deployments": 4 * n, "pipelines": n}
        t0 = time.time()
        load0 = loadavg()
        sampler = asyncio.create_task(sample_loop(prog, t0, op.pid, stop, totals, f"[N={n} operator]", book))
        cr = await create_pipelines(admin, docs, cfg.workers, on_created)
        res.update(cr)
        log(f"[N={n}] {n} pipelines applied in {cr['create_s']:.1f}s ({cr['create_errors']} errors)")
        deadline = t0 + limit
        while time.time() < deadline:
            if len(prog.ready_at) >= n and len(prog.child_created) >= n * per_pipeline:
                break
            if not op.alive():
                res["operator_died"] = True
                break
            await asyncio.sleep(0.5)
        prog.poll_audit()
        res["timed_out"] = len(prog.ready_at) < n or len(prog.child_created) < n * per_pipeline
        res["limit_s"] = limit
        end = time.time()
        # Settle: until the operator has written nothing for a few seconds (a last Event, say).
        quiet_since, seen = time.time(), len(tail.events)
        settle_deadline = time.time() + SETTLE_MAX_S
        while time.time() < settle_deadline and time.time() - quiet_since < SETTLE_QUIET_S and not res["timed_out"]:
            await asyncio.sleep(0.5)
            prog.poll_audit()
            if len(tail.events) != seen:
                seen, quiet_since = len(tail.events), time.time()
        stop.set()
        await sampler
        cpu = book.delta()
        res["cpu_s"] = cpu
        res["load_start"], res["load_end"] = load0, loadavg()
        res["children_created"] = len(prog.child_created)
        res["pipelines_ready"] = len(prog.ready_at)
        res["deployments_ready"] = len(prog.dep_ready_at)
        if prog.child_created:
            res["t_children_s"] = round(max(prog.child_created.values()) - t0, 2) if not res["timed_out"] or \
                len(prog.child_created) >= n * per_pipeline else None
            res["t_last_child_seen_s"] = round(max(prog.child_created.values()) - t0, 2)
        if len(prog.ready_at) >= n:
            res["t_ready_s"] = round(max(prog.ready_at.values()) - t0, 2)
        if len(prog.dep_ready_at) >= 4 * n:
            res["t_deployments_ready_s"] = round(max(prog.dep_ready_at.values()) - t0, 2)
        res["ready_latency_s"] = quantiles([prog.ready_at[k] - created_at[k] for k in prog.ready_at if k in created_at])
        # Status lag: from the last of a pipeline's 4 Deployments ready to the pipeline seen Ready.
        lags = []
        for (ns, name), at in prog.ready_at.items():
            deps = [prog.dep_ready_at.get((ns, f"{name}-{s}")) for s in ("master", "a", "b", "c")]
            if all(deps):
                lags.append(at - max(deps))
        res["status_lag_s"] = quantiles(lags)
        per_pipe_children: dict[tuple[str, str], float] = {}
        for (_, ns, name), at in prog.child_created.items():
            # children are named <pipeline>[-suffix]; pipelines here are p0000 .. p9999
            key = (ns, name[:5])
            per_pipe_children[key] = max(per_pipe_children.get(key, 0.0), at)
        res["children_latency_s"] = quantiles([per_pipe_children[k] - created_at[k] for k in per_pipe_children
                                               if k in created_at])
        writes = tail.since(prog.mark, OPERATOR_USER)
        res["writes"] = summarize(writes)
        res["writes_total"] = len(writes)
        res["writes_per_pipeline"] = round(len(writes) / n, 2)
        res["writes_by_user"] = tail.users_since(prog.mark)
        errs = [describe(e) for e in writes if classify(e) == "error"]
        res["write_errors_first"] = errs[:5]
        mem = proc_mem_mib(op.pid)
        res["op_rss_before_mib"] = round(rss0.get("VmRSS", 0), 1)
        res["op_peak_rss_mib"] = round(mem.get("VmHWM", 0), 1)
        res["op_rss_end_mib"] = round(mem.get("VmRSS", 0), 1)
        res["op_cpu_s"] = round((proc_cpu_s(op.pid) or 0) - (op_cpu0 or 0), 2)
        res["watch_events"] = {"pipelines": pw.events, "deployments": dw.events}
        res["timeline"] = prog.timeline
        res["settled_after_s"] = round(time.time() - end, 1)
        log(f"[N={n}] operator: children {res.get('t_children_s')}s, Ready {res.get('t_ready_s')}s, "
            f"deployments ready {res.get('t_deployments_ready_s')}s, writes/pipeline {res['writes_per_pipeline']} "
            f"{res['writes']}, peak RSS {res['op_peak_rss_mib']} MiB, CPU {res['op_cpu_s']}s")
        if profile_out:
            op.signal(signal.SIGUSR1)
            await asyncio.sleep(2.0)
        for w in watches:
            w.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        watches = []
        await admin.close()

        if idle and not res["timed_out"] and op.alive():
            window = cfg.resync * cfg.idle_periods + 2.0
            log(f"[N={n}] idle: {window:.0f}s ({cfg.idle_periods} resync periods of {cfg.resync:g}s), nothing changes")
            mark = tail.mark()
            cpu_i0 = proc_cpu_s(op.pid)
            ibook = CpuBook({**component_pids(c), "operator": op.pid})
            await asyncio.sleep(window)
            tail.poll()
            idle = tail.since(mark, OPERATOR_USER)
            icpu = (proc_cpu_s(op.pid) or 0) - (cpu_i0 or 0)
            res["idle"] = {"window_s": window, "periods": cfg.idle_periods, "writes": len(idle),
                           "writes_first": [describe(e) for e in idle[:10]], "op_cpu_s": round(icpu, 2),
                           "op_cpu_s_per_resync": round(icpu / cfg.idle_periods, 3),
                           "op_cpu_ms_per_pipeline_per_resync": round(1000 * icpu / cfg.idle_periods / n, 3),
                           "writes_by_user": tail.users_since(mark), "cpu_s": ibook.delta(),
                           "op_peak_rss_mib": round(proc_mem_mib(op.pid).get("VmHWM", 0), 1)}
            log(f"[N={n}] idle: operator writes {len(idle)}, CPU {icpu:.2f}s")
        res["operator_log_errors"] = _log_errors(op.log)
        return res
    finally:
        for w in watches:
            w.cancel()
        if op is not None:
            op.stop()
        c.down()


def _log_errors(path: Path) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    bad = [ln for ln in lines if "ERROR" in ln or "Traceback" in ln
           or re.search(r"\b429\b", ln.split("] ", 1)[-1])]  # not the milliseconds of a timestamp
    return bad[:10]


async def direct_phase(n: int, cfg: argparse.Namespace, docs: list[dict], rendered: dict, state_dir: Path,
                       per_pipeline: int) -> dict[str, Any]:
    from omnifleet_operator.reconcile import Api
    from omnifleet_runtime import constants as C

    res: dict[str, Any] = {"n": n, "children_expected": n * per_pipeline}
    limit = phase_limit(n)
    log(f"[N={n}] direct phase: fresh cluster in {state_dir}, no operator")
    c = start_cluster(state_dir, n, cfg.namespaces)
    watches: list[asyncio.Task] = []
    try:
        sa_kc = c.sa_kubeconfig(dev.OPERATOR_NAMESPACE, dev.OPERATOR_SA)
        tail = AuditTail(c.audit_log, (OPERATOR_USER,))
        prog = Progress(tail, OPERATOR_USER)
        dw = RawWatch(c, "/apis/apps/v1/deployments", prog.on_deployment, {"labelSelector": LABEL_PIPELINE})
        watches = [asyncio.create_task(dw.run())]
        await asyncio.sleep(1.0)
        admin = async_client(c.kubeconfig, BENCH_FIELD_MANAGER)
        api = Api(async_client(sa_kc, C.FIELD_MANAGER), applies_in_flight=cfg.workers)
        queue: asyncio.Queue = asyncio.Queue()

        def on_created(d: dict, uid: str) -> None:
            queue.put_nowait(with_owner(rendered[(d["metadata"]["namespace"], d["metadata"]["name"])], uid))

        book = CpuBook(component_pids(c))
        stop = asyncio.Event()
        totals = {"children": n * per_pipeline, "deployments": 4 * n, "pipelines": n}
        t0 = time.time()
        load0 = loadavg()
        sampler = asyncio.create_task(sample_loop(prog, t0, None, stop, totals, f"[N={n} direct]", book))
        applier = asyncio.create_task(direct_apply(api, queue, cfg.workers))
        cr = await create_pipelines(admin, docs, cfg.workers, on_created)
        queue.put_nowait(None)
        res.update(cr)
        try:
            ar = await asyncio.wait_for(applier, max(1.0, t0 + limit - time.time()))
            res.update(ar)
            res["t_direct_client_s"] = round(ar["last_apply_at"] - t0, 2) if ar["last_apply_at"] else None
        except asyncio.TimeoutError:
            res["applier_timed_out"] = True
        prog.poll_audit()
        res["children_created"] = len(prog.child_created)
        if len(prog.child_created) >= n * per_pipeline:
            res["t_children_s"] = round(max(prog.child_created.values()) - t0, 2)
        res["cpu_s_to_children"] = book.delta()
        log(f"[N={n}] direct: children {res.get('t_children_s')}s ({res['children_created']} created, "
            f"{res.get('apply_errors')} errors); waiting for Deployments ready (the cluster's floor)")
        while time.time() < t0 + limit and len(prog.dep_ready_at) < 4 * n:
            await asyncio.sleep(0.5)
        stop.set()
        await sampler
        res["timed_out"] = res.get("t_children_s") is None or len(prog.dep_ready_at) < 4 * n
        res["limit_s"] = limit
        res["deployments_ready"] = len(prog.dep_ready_at)
        if len(prog.dep_ready_at) >= 4 * n:
            res["t_deployments_ready_s"] = round(max(prog.dep_ready_at.values()) - t0, 2)
        res["cpu_s"] = book.delta()
        res["load_start"], res["load_end"] = load0, loadavg()
        writes = tail.since(prog.mark, OPERATOR_USER)
        res["writes"] = summarize(writes)
        res["writes_per_pipeline"] = round(len(writes) / n, 2)
        res["writes_by_user"] = tail.users_since(prog.mark)
        res["timeline"] = prog.timeline
        res["request_total_labels"] = _request_total_labels(c)
        log(f"[N={n}] direct: deployments ready {res.get('t_deployments_ready_s')}s")
        await admin.close()
        await api.client.close()
        return res
    finally:
        for w in watches:
            w.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        c.down()


def _request_total_labels(c: DevCluster) -> list[str]:
    """The label names of apiserver_request_total (to show that no client/user label exists)."""
    try:
        for line in c.metrics().splitlines():
            if line.startswith("apiserver_request_total{"):
                inner = line[len("apiserver_request_total{"):line.index("}")]
                return sorted({kv.split("=", 1)[0] for kv in inner.split(",")})
    except Exception:  # noqa: BLE001
        pass
    return []


# ---------------------------------------------------------------- profile summary


def profile_summary(path: Path, top: int = 30) -> str:
    import io

    out = io.StringIO()
    st = pstats.Stats(str(path), stream=out)
    st.strip_dirs().sort_stats("tottime").print_stats(top)
    out.write("\n\n==== by cumulative time ====\n")
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# ---------------------------------------------------------------- report


def fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return round(a / b, 3)


def sizes_of(results: list[dict]) -> list[int]:
    return sorted({r["n"] for r in results})


def rounds_of(results: list[dict], n: int) -> list[dict]:
    return [r for r in results if r["n"] == n]


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(common.pct(xs, 50), 3) if xs else None


def med(results: list[dict], n: int, phase: str, key: str) -> float | None:
    return median([(r.get(phase) or {}).get(key) for r in rounds_of(results, n)])


OUTSIDE_LOAD_MAX = 0.15  # cores other work may take during a phase for its round to count as clean


def outside_load(ph: dict) -> float | None:
    """Cores the rest of the machine (not this benchmark) took during a phase, on average."""
    cpu = ph.get("cpu_s") or {}
    if not cpu.get("wall_s"):
        return None
    return round(cpu.get("others", 0.0) / cpu["wall_s"], 2)


def clean(r: dict) -> bool:
    loads = [outside_load(r.get(p) or {}) for p in ("operator", "direct")]
    return all(x is not None and x <= OUTSIDE_LOAD_MAX for x in loads)


def headline_rounds(results: list[dict], n: int) -> tuple[list[dict], str]:
    """The rounds the headline at N uses: the clean ones (all if none is clean)."""
    rs = rounds_of(results, n)
    good = [r for r in rs if clean(r) and round_ratio(r) is not None]
    if good:
        return good, f"{len(good)} of {len(rs)} rounds clean"
    return rs, f"no clean round of {len(rs)}: median of all"


def headline_ratio(results: list[dict], n: int) -> tuple[float | None, str]:
    """Median operator/direct over the clean rounds at N (all rounds if none is clean)."""
    rs, how = headline_rounds(results, n)
    return median([round_ratio(r) for r in rs]), how


def round_ratio(r: dict) -> float | None:
    return ratio((r.get("operator") or {}).get("t_children_s"), (r.get("direct") or {}).get("t_children_s"))


def at_children(ph: dict) -> dict | None:
    """The timeline sample taken when all children existed (or the last one)."""
    tl = ph.get("timeline") or []
    t = ph.get("t_children_s")
    if not tl:
        return None
    if t is None:
        return tl[-1]
    return next((row for row in tl if row["t"] >= t), tl[-1])


def lab(r: dict) -> str:
    return f"{r['n']}" + (f" #{r['round']}" if r.get("rounds", 1) > 1 else "")


def plots(results: list[dict], stamp: str, out_dir: Path, suffix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    ns = sizes_of(results)

    def series(phase: str, key: str) -> list[float | None]:  # the rounds the headline uses (clean ones)
        return [med(headline_rounds(results, n)[0], n, phase, key) for n in ns]

    def plot_line(ax, xs, ys, **kw):
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", **kw)

    def log_log(ax) -> None:  # growth with N: log-log once there are several N
        if len(ns) > 1:
            ax.set_xscale("log")
            ax.set_yscale("log")

    def save(fig, kind: str) -> None:
        fig.tight_layout()
        names.append(f"{stamp}-control-plane{suffix}-{kind}.png")
        fig.savefig(out_dir / names[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_line(ax, ns, series("operator", "t_children_s"), label="operator: all children exist")
    plot_line(ax, ns, series("direct", "t_children_s"), label="direct SSA client: all children exist", ls="--")
    plot_line(ax, ns, series("operator", "t_ready_s"), label="operator: all pipelines Ready")
    plot_line(ax, ns, series("operator", "t_deployments_ready_s"), label="operator run: all Deployments ready")
    plot_line(ax, ns, series("direct", "t_deployments_ready_s"), label="direct run: all Deployments ready", ls="--")
    log_log(ax)
    ax.set_xlabel("pipelines applied at once (N)")
    ax.set_ylabel("seconds from the first apply (median of clean rounds)")
    ax.set_title("Control plane: time vs N")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "time")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    plot_line(a1, ns, series("operator", "op_peak_rss_mib"), label="peak RSS (VmHWM)")
    plot_line(a1, ns, series("operator", "op_rss_before_mib"), label="RSS before the pipelines", ls=":")
    a1.set_xlabel("N")
    a1.set_ylabel("MiB")
    a1.set_title("operator memory")
    plot_line(a2, ns, series("operator", "op_cpu_s"), label="operator")
    for comp in ("kube-apiserver", "etcd", "kube-controller-manager"):
        plot_line(a2, ns, [median([((r.get("operator") or {}).get("cpu_s") or {}).get(comp)
                                   for r in headline_rounds(results, n)[0]]) for n in ns],
                  label=f"{comp} (same window)", ls="--")
    a2.set_xlabel("N")
    a2.set_ylabel("CPU seconds")
    a2.set_title("CPU seconds, apply -> all Ready (operator run)")
    for a in (a1, a2):
        log_log(a)
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    save(fig, "resources")

    big = next((r for r in headline_rounds(results, ns[-1])[0] if (r.get("operator") or {}).get("timeline")),
               None) if ns else None
    if big:
        n = big["n"]
        tl = big["operator"]["timeline"]
        dtl = (big.get("direct") or {}).get("timeline") or []
        exp = big["operator"]["children_expected"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        a1.plot([r["t"] for r in tl], [r["children"] / exp for r in tl], label="operator: children")
        a1.plot([r["t"] for r in tl], [r["ready"] / n for r in tl], label="operator: pipelines Ready")
        a1.plot([r["t"] for r in tl], [r["deployments_ready"] / (4 * n) for r in tl],
                label="operator run: Deployments ready")
        if dtl:
            a1.plot([r["t"] for r in dtl], [r["children"] / exp for r in dtl], ls="--", label="direct: children")
            a1.plot([r["t"] for r in dtl], [r["deployments_ready"] / (4 * n) for r in dtl], ls="--",
                    label="direct run: Deployments ready")
        a1.set_xlabel("seconds from the first apply")
        a1.set_ylabel("fraction done")
        a1.set_title(f"N={n} (round {big.get('round', 1)}): progress")
        a1.grid(True, alpha=0.3)
        a1.legend(fontsize=7)
        a2.plot([r["t"] for r in tl], [r["op_rss_mib"] for r in tl], label="operator RSS (MiB)")
        a2.set_xlabel("seconds from the first apply")
        a2.set_ylabel("MiB")
        a3 = a2.twinx()
        ts = [r["t"] for r in tl]
        cpus = [r["op_cpu_s"] or 0 for r in tl]
        util = [0.0] + [(cpus[i] - cpus[i - 1]) / max(1e-6, ts[i] - ts[i - 1]) for i in range(1, len(tl))]
        a3.plot(ts, util, color="tab:red", alpha=0.5, label="operator CPU (cores)")
        a3.set_ylabel("cores")
        a2.set_title(f"N={n}: operator RSS and CPU")
        a2.grid(True, alpha=0.3)
        h1, l1 = a2.get_legend_handles_labels()
        h2, l2 = a3.get_legend_handles_labels()
        a2.legend(h1 + h2, l1 + l2, fontsize=7)
        save(fig, "timeline")
    return names


def headline(results: list[dict]) -> dict[str, Any]:
    h: dict[str, Any] = {}
    for n in sizes_of(results):
        rs = rounds_of(results, n)
        h[f"operator_over_direct_children_N{n}"] = headline_ratio(results, n)[0]
        h[f"operator_over_direct_children_rounds_N{n}"] = [round_ratio(r) for r in rs]
        h[f"outside_load_cores_rounds_N{n}"] = [[outside_load(r.get(p) or {}) for p in ("operator", "direct")]
                                               for r in rs]
        h[f"op_peak_rss_mib_rounds_N{n}"] = [(r.get("operator") or {}).get("op_peak_rss_mib") for r in rs]
        used, how = headline_rounds(results, n)
        h[f"headline_rounds_N{n}"] = how
        h[f"operator_children_s_N{n}"] = med(used, n, "operator", "t_children_s")
        h[f"direct_children_s_N{n}"] = med(used, n, "direct", "t_children_s")
        h[f"operator_ready_s_N{n}"] = med(used, n, "operator", "t_ready_s")
        h[f"ready_over_direct_deployments_ready_N{n}"] = ratio(med(used, n, "operator", "t_ready_s"),
                                                               med(used, n, "direct", "t_deployments_ready_s"))
        h[f"writes_per_pipeline_N{n}"] = med(results, n, "operator", "writes_per_pipeline")
        idle = [(r.get("operator") or {}).get("idle") for r in rs]
        idle = [i for i in idle if i]
        if idle:
            h[f"idle_writes_N{n}"] = idle[0]["writes"]
        h[f"op_peak_rss_mib_N{n}"] = med(results, n, "operator", "op_peak_rss_mib")
        h[f"op_cpu_s_N{n}"] = med(results, n, "operator", "op_cpu_s")
        if any((r.get("operator") or {}).get("timed_out") for r in rs):
            h[f"timed_out_N{n}"] = True
    return h


def write_report(results: list[dict], cfg: argparse.Namespace, facts: dict, per_pipeline: int,
                 started: float) -> Path:
    stamp = cfg.stamp
    out = cfg.results
    pngs = plots(results, stamp, out, "-quick" if cfg.quick else "")
    ns = sizes_of(results)
    L: list[str] = []
    L.append(f"# Control-plane benchmark{' (quick)' if cfg.quick else ''}\n")
    L.append("N three-stage pipelines (stage gpus 1, replicas 1; "
             f"{per_pipeline} children each: ServiceAccount, ConfigMap, NetworkPolicy, master Deployment + "
             "Service, per stage Deployment + Service + PodDisruptionBudget) applied at once to a fresh "
             "DevCluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok on loopback) "
             f"with N/10+2 kwok nodes of {GPUS_PER_NODE} GPUs, in {cfg.namespaces} namespaces; the real operator "
             "runs as the omnifleet-operator ServiceAccount. The limit: the same children applied by a plain "
             "bulk server-side-apply client on a second fresh cluster. "
             f"`{facts.get('command')}` (took {facts.get('took_min')} min).\n")
    L.append(common.facts_table(facts) + "\n")

    L.append("## Headlines\n")
    L.append("| what | value | goal | verdict |\n| --- | --- | --- | --- |")
    for n in ns:
        rs = rounds_of(results, n)
        rt, how = headline_ratio(results, n)
        each = [f"{fmt(round_ratio(r), '', 2)}{'' if clean(r) else ' (outside load)'}" for r in rs]
        goal = "<= 1.25 (at N=1000)" if n == 1000 else "-"
        verdict = "-" if rt is None else ("meets" if rt <= 1.25 else "MISSES") if n == 1000 else \
            ("(<= 1.25)" if rt <= 1.25 else "(> 1.25)")
        part = " (partial: time limit)" if any((r.get("operator") or {}).get("timed_out") for r in rs) else ""
        rounds = f"; rounds: {', '.join(each)}; {how}" if len(rs) > 1 else ("" if clean(rs[0]) else f"; {how}")
        used, _ = headline_rounds(results, n)
        L.append(f"| N={n}: operator / direct, time to all children{part} | {fmt(rt, 'x', 2)} "
                 f"({fmt(med(used, n, 'operator', 't_children_s'), ' s')} / "
                 f"{fmt(med(used, n, 'direct', 't_children_s'), ' s')}{rounds}) | {goal} | {verdict} |")
    for n in ns:
        idle = next(((r.get("operator") or {}).get("idle") for r in rounds_of(results, n)
                     if (r.get("operator") or {}).get("idle")), None)
        if idle is not None:
            L.append(f"| N={n}: operator writes while idle, {idle['periods']} resync periods of "
                     f"{cfg.resync:g} s | {idle['writes']} | 0 | {'meets' if idle['writes'] == 0 else 'MISSES'} |")
        else:
            L.append(f"| N={n}: operator writes while idle | not measured (not all Ready in time) | 0 | - |")
    L.append("")

    L.append("## Time and memory vs N\n")
    L.append("Seconds from the first pipeline apply. *children*: the last child's creation (its 201 in the "
             "audit log). *Ready*: the last pipeline seen Ready=True at its generation (a watch). "
             "*Deployments ready*: the last of the 4N Deployments with its replica ready (the cluster's "
             "own work: ReplicaSets, pods, scheduling, kwok). Per-pipeline latencies are from its own apply; "
             "*status lag*: from the last of a pipeline's 4 Deployments ready to the pipeline seen Ready. "
             "`N #k`: round k (odd rounds ran the operator first, even rounds the direct client first, unless "
             "--direct-first). *Outside load*: cores that other work on this shared machine took during the phase "
             f"(machine busy minus this benchmark's processes); a round is *clean* when both phases stay <= "
             f"{OUTSIDE_LOAD_MAX} cores, and the headline ratio is the median of the clean rounds.\n")
    L.append("| N | nodes | children | operator: all children (s) | direct: all children (s) | operator / direct | "
             "operator: all Ready (s) | Deployments ready, operator run (s) | Deployments ready, direct run (s) | "
             "per pipeline: children p50 / p90 (s) | per pipeline: Ready p50 / p90 (s) | status lag p50 / p90 (s) | "
             "pipelines applied in, op / direct (s) | outside load, op / direct phase (cores) |")
    L.append("| " + " | ".join(["---"] * 14) + " |")
    for r in results:
        op, d = r.get("operator") or {}, r.get("direct") or {}
        cl, rl = op.get("children_latency_s") or {}, op.get("ready_latency_s") or {}
        sl = op.get("status_lag_s") or {}
        partial = ""
        if op.get("timed_out"):
            partial = (f" (partial, limit {fmt(op.get('limit_s'), ' s', 0)}: {op.get('children_created')} children, "
                       f"{op.get('pipelines_ready')} Ready{', ' + op['error'] if op.get('error') else ''})")
        L.append(f"| {lab(r)}{partial} | {nodes_for(r['n'])} | {r['n'] * per_pipeline} | {fmt(op.get('t_children_s'))} | "
                 f"{fmt(d.get('t_children_s'))} | {fmt(round_ratio(r), 'x', 2)} | "
                 f"{fmt(op.get('t_ready_s'))} | {fmt(op.get('t_deployments_ready_s'))} | "
                 f"{fmt(d.get('t_deployments_ready_s'))} | {fmt(cl.get('p50'))} / {fmt(cl.get('p90'))} | "
                 f"{fmt(rl.get('p50'))} / {fmt(rl.get('p90'))} | {fmt(sl.get('p50'))} / {fmt(sl.get('p90'))} | "
                 f"{fmt(op.get('create_s'))} / {fmt(d.get('create_s'))} | "
                 f"{fmt(outside_load(op), '', 2)} / {fmt(outside_load(d), '', 2)} |")
    L.append("")
    L.append("| N | operator peak RSS (MiB) | RSS before (MiB) | peak RSS growth per pipeline (KiB) | operator CPU s, "
             "apply -> settled | CPU ms per pipeline | idle: CPU s per resync | idle: CPU ms per pipeline per resync | "
             "idle writes |")
    L.append("| " + " | ".join(["---"] * 9) + " |")
    for r in results:
        op = r.get("operator") or {}
        idle = op.get("idle") or {}
        grow = None
        if op.get("op_peak_rss_mib") and op.get("op_rss_before_mib"):
            grow = (op["op_peak_rss_mib"] - op["op_rss_before_mib"]) * 1024 / r["n"]
        L.append(f"| {lab(r)} | {fmt(op.get('op_peak_rss_mib'))} | {fmt(op.get('op_rss_before_mib'))} | {fmt(grow)} | "
                 f"{fmt(op.get('op_cpu_s'))} | {fmt(1000 * op['op_cpu_s'] / r['n'] if op.get('op_cpu_s') else None)} | "
                 f"{fmt(idle.get('op_cpu_s_per_resync'), '', 2)} | "
                 f"{fmt(idle.get('op_cpu_ms_per_pipeline_per_resync'), '', 2)} | {fmt(idle.get('writes'))} |")
    L.append("")
    for p in pngs:
        L.append(f"![{p}]({p})\n")

    L.append("## Write requests\n")
    L.append("Writes by the operator's user from the first pipeline apply until everything was Ready and the "
             "operator had been quiet for 5 s, from the apiserver's audit log (every create/update/patch/delete "
             "is logged once). The direct client writes exactly one apply per child.\n")
    L.append("| N | operator writes / pipeline | child creates | child updates | status patches | Events | errors | "
             "direct client writes / pipeline |")
    L.append("| " + " | ".join(["---"] * 8) + " |")
    for r in results:
        op, d = r.get("operator") or {}, r.get("direct") or {}
        w = op.get("writes") or {}
        L.append(f"| {lab(r)} | {fmt(op.get('writes_per_pipeline'), '', 2)} | {w.get('child_create', 0)} | "
                 f"{w.get('child_update', 0)} | {w.get('status', 0)} | {w.get('event', 0)} | {w.get('error', 0)} | "
                 f"{fmt(d.get('writes_per_pipeline'), '', 2)} |")
    L.append("")
    labels = next((r["direct"].get("request_total_labels") for r in results if (r.get("direct") or {}).get(
        "request_total_labels")), None)
    if labels:
        L.append(f"`apiserver_request_total` labels in this Kubernetes: {', '.join(labels)}: no client, user or "
                 "field-manager label, so it cannot say who wrote; the audit log can.\n")

    L.append("## Who did the work until all children existed (CPU seconds)\n")
    L.append("From the 1 s samples: CPU seconds from the first apply to the first sample after the last child "
             "was created. *others/wall*: cores the rest of the machine (other work, not this benchmark) took "
             "meanwhile; the two phases of one N ran one after the other, so they can differ a lot.\n")
    comps_c = ["operator", "kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok", "bench",
               "others"]
    L.append("| N | phase | until (s) | " + " | ".join(comps_c) + " | others / wall (cores) | operator status patches "
             "+ Events by then |")
    L.append("| " + " | ".join(["---"] * (len(comps_c) + 5)) + " |")
    for r in results:
        for phase in ("operator", "direct"):
            row = at_children(r.get(phase) or {})
            if not row or "cpu" not in row:
                continue
            cpu = row["cpu"]
            w = row.get("writes") or {}
            sw = f"{w.get('status', 0)} + {w.get('event', 0)}" if phase == "operator" else "-"
            L.append(f"| {lab(r)} | {phase} | {fmt(row['t'])} | " + " | ".join(fmt(cpu.get(k)) for k in comps_c)
                     + f" | {fmt(cpu.get('others', 0) / max(row['t'], 1e-6), '', 2)} | {sw} |")
    L.append("")
    L.append("## Who did the work (CPU seconds, apply -> settled)\n")
    L.append("CPU seconds (utime+stime from /proc) over the same window; *others*: the rest of the machine "
             "(this 2-core machine is shared with other work); *busy*: the whole machine; *wall*: the window.\n")
    comps = ["operator", "kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok", "bench",
             "others", "machine_busy", "wall_s"]
    L.append("| N | phase | " + " | ".join(comps) + " | load avg start -> end |")
    L.append("| " + " | ".join(["---"] * (len(comps) + 3)) + " |")
    for r in results:
        for phase in ("operator", "direct"):
            ph = r.get(phase) or {}
            cpu = ph.get("cpu_s") or {}
            if cpu:
                L.append(f"| {lab(r)} | {phase} | " + " | ".join(fmt(cpu.get(k)) for k in comps)
                         + f" | {ph.get('load_start')} -> {ph.get('load_end')} |")
    L.append("")
    L.append("Writes by user (user agent) in the operator run, apply -> settled (kube-controller-manager, "
             "kube-scheduler and kwok all use the admin kubeconfig here):\n")
    for r in results:
        wb = (r.get("operator") or {}).get("writes_by_user") or {}
        top = sorted(wb.items(), key=lambda kv: -kv[1])[:8]
        L.append(f"- N={lab(r)}: " + ", ".join(f"{u} {c}" for u, c in top))
    L.append("")
    for r in results:
        op = r.get("operator") or {}
        idle = op.get("idle") or {}
        if idle.get("writes"):
            L.append(f"Idle writes at N={lab(r)}: " + "; ".join(idle["writes_first"]) + "\n")
        if op.get("write_errors_first"):
            L.append(f"Failed writes at N={lab(r)}: " + "; ".join(op["write_errors_first"]) + "\n")

    seen: dict[str, list[str]] = {}  # operator log lines worth a look, without timestamp and port, by round
    for r in results:
        for line in (r.get("operator") or {}).get("operator_log_errors") or []:
            key = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line.split("] ", 1)[-1])
            seen.setdefault(key, []).append(lab(r))
    if seen:
        L.append("Operator log lines with ERROR, Traceback or 429 (first 10 per round; timestamps and ports "
                 "dropped):\n")
        for key, where in seen.items():
            L.append(f"- N={', '.join(where)}: `{key[:400]}`")
        L.append("")
    if cfg.analysis and Path(cfg.analysis).exists():
        L.append(Path(cfg.analysis).read_text())
    for r in results:
        if r.get("profile_summary"):
            L.append(f"## cProfile of the operator at N={r['n']} (all threads, thread CPU time)\n")
            L.append(f"`{r['profile_file']}`, apply -> settled. Top functions:\n\n```\n{r['profile_summary']}\n```\n")
    path = out / f"{stamp}-control-plane{'-quick' if cfg.quick else ''}.md"
    path.write_text("\n".join(L) + "\n")
    return path



def merge_latest(results: list[dict], cfg: argparse.Namespace, facts: dict, report: Path, prov: dict) -> None:
    h = {k: v for k, v in headline(results).items() if v is not None}
    h.update({"report": report.name, "machine": f"{common.machine_line(facts)} (shared)"})
    common.merge_latest(cfg.results, "control_plane", h, prov)


# ---------------------------------------------------------------- main


def leftover_processes(root: Path) -> list[str]:
    """Processes whose command line mentions one of our state dirs (should be none at the end)."""
    out = []
    needle = str(root)
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            out.append(f"{pid} {cmd[:120]}")
    return out


async def run_size(n: int, cfg: argparse.Namespace, root: Path, per_pipeline: int, rnd: int = 1,
                   rounds: int = 1) -> dict[str, Any]:
    """One round at size N: the operator phase and the direct phase (odd rounds operator first, even
    rounds direct first, so a drift in the machine's other load hits both alike)."""
    docs = pipeline_docs(n, cfg.namespaces)
    t = time.perf_counter()
    rendered = prerender(docs)
    r: dict[str, Any] = {"n": n, "round": rnd, "rounds": rounds, "render_s": round(time.perf_counter() - t, 3)}
    prof = cfg.results / f"{cfg.stamp}-control-plane-N{n}.prof" if cfg.profile and rnd == 1 else None

    async def op_phase() -> None:
        try:
            r["operator"] = await operator_phase(n, cfg, docs, root / f"op-{n}-{rnd}", per_pipeline, idle=rnd == 1,
                                                 profile_out=prof)
        except Exception as err:  # noqa: BLE001 - reported, the next phase still runs
            log(f"[N={n}] operator phase failed: {type(err).__name__}: {err}")
            r["operator"] = {"error": f"{type(err).__name__}: {err}", "timed_out": True}
        if prof is not None and prof.exists():
            r["profile_file"] = prof.name
            r["profile_summary"] = profile_summary(prof)
            (cfg.results / f"{cfg.stamp}-control-plane-N{n}-profile.txt").write_text(r["profile_summary"])

    async def direct() -> None:
        if cfg.skip_direct:
            return
        try:
            r["direct"] = await direct_phase(n, cfg, docs, rendered, root / f"direct-{n}-{rnd}", per_pipeline)
        except Exception as err:  # noqa: BLE001
            log(f"[N={n}] direct phase failed: {type(err).__name__}: {err}")
            r["direct"] = {"error": f"{type(err).__name__}: {err}"}

    op_first = (rnd % 2 == 1) != cfg.direct_first
    r["order"] = "operator first" if op_first else "direct first"
    for phase in ((op_phase, direct) if op_first else (direct, op_phase)):
        await phase()
    op, d = r["operator"], r.get("direct") or {}
    log(f"[N={n} round {rnd}/{rounds}] operator / direct, time to all children: {ratio(op.get('t_children_s'), d.get('t_children_s'))} "
        f"({op.get('t_children_s')} s / {d.get('t_children_s')} s)")
    return r


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="comma-separated N (default 10,100,500,1000; --quick: 10)")
    p.add_argument("--quick", action="store_true", help="N=10, 5 s resync, 2 idle periods; report *-quick.md, "
                   "latest.json untouched")
    p.add_argument("--workers", type=int, default=8, help="operator OMNIFLEET_WORKERS = direct client concurrency")
    p.add_argument("--resync", type=float, default=None, help="operator OMNIFLEET_RESYNC_SECONDS (default 20; quick 5)")
    p.add_argument("--idle-periods", type=int, default=None, help="resync periods of the idle window (default 3)")
    p.add_argument("--watch-timeout", type=int, default=300, help="operator OMNIFLEET_WATCH_TIMEOUT")
    p.add_argument("--namespaces", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="run the operator under cProfile (bench.cp_operator); "
                   "times are then not the operator's own")
    p.add_argument("--experiment", default="", help="bench-only operator changes (bench.cp_operator): "
                   "nodiffbase, rendercache (comma-separated)")
    p.add_argument("--rounds", default=None, help="rounds per N, e.g. '10:3,100:2' (default: 3 for N<=10, "
                   "2 for N<=100, else 1; --quick: 1); the headline is the median ratio")
    p.add_argument("--direct-first", action="store_true", help="odd rounds run the direct phase first")
    p.add_argument("--skip-direct", action="store_true")
    p.add_argument("--keep-state", action="store_true", help="keep the clusters' state dirs (logs) at the end")
    p.add_argument("--analysis", default=None, help="a markdown file appended to the report (findings)")
    p.add_argument("--tag", default="", help="suffix of the result files' date stamp")
    p.add_argument("--no-latest", action="store_true", help="do not merge into latest.json")
    p.add_argument("--from-json", default=None, help="only rebuild the report (and latest.json) from a "
                   "results JSON of an earlier run, e.g. to add --analysis")
    cfg = p.parse_args(argv)
    cfg.argv = argv
    cfg.sizes = [int(s) for s in (cfg.sizes or ("10" if cfg.quick else "10,100,500,1000")).split(",")]
    cfg.resync = cfg.resync if cfg.resync is not None else (5.0 if cfg.quick else 20.0)
    cfg.idle_periods = cfg.idle_periods if cfg.idle_periods is not None else (2 if cfg.quick else 3)
    rounds_map = dict(kv.split(":") for kv in cfg.rounds.split(",")) if cfg.rounds else {}
    cfg.rounds_for = lambda n: int(rounds_map.get(str(n), 1 if cfg.quick or cfg.profile else 3 if n <= 10 else
                                              2 if n <= 100 else 1))
    cfg.results = common.RESULTS
    cfg.results.mkdir(parents=True, exist_ok=True)
    cfg.stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d") + cfg.tag

    if cfg.from_json:
        paths = [Path(x) for x in cfg.from_json.split(",")]
        saved = [json.loads(x.read_text()) for x in paths]
        facts, results = saved[0]["facts"], [r for sv in saved for r in sv["results"]]
        if len(saved) > 1:  # rounds of several runs, e.g. an extra round at one N
            for sv, x in zip(saved[1:], paths[1:]):
                facts[f"also from {x.name}"] = f"{sv['facts'].get('command')} ({sv['facts'].get('date')}, " \
                                                f"took {sv['facts'].get('took_min')} min)"
            results.sort(key=lambda r: r["n"])  # stable: rounds keep their order
            for n in sizes_of(results):
                rs = rounds_of(results, n)
                for i, r in enumerate(rs, 1):
                    r["round"], r["rounds"] = i, len(rs)
        cfg.stamp = paths[0].name[:10] + cfg.tag
        cfg.quick = paths[0].stem.endswith("-quick")
        cfg.resync = float(facts.get("resync_s") or 20)
        per_pipeline = len(next(iter(prerender(pipeline_docs(1)).values())))
        report = write_report(results, cfg, facts, per_pipeline, time.time())
        if not cfg.quick and not cfg.no_latest:
            merge_latest(results, cfg, facts, report,
                         common.provenance_of_results("control_plane", facts, ",".join(p.name for p in paths)))
        log(f"report: {report}")
        return 0

    build.ensure_binaries(verbose=True)
    prov = common.provenance("control_plane")
    facts = common.machine_facts()
    facts["command"] = " ".join([".venv/bin/python -m bench.control_plane"] + argv)
    facts["resync_s"] = cfg.resync
    for k in ("zmq", "libzmq", "msgspec", "aiohttp", "numpy", "torch", "runtime measured"):
        facts.pop(k, None)
    facts["kubernetes (etcd, kwok)"] = build.VERSIONS_KEY
    for pkg in ("kopf", "lightkube", "httpx2"):
        try:
            facts[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    facts["operator settings"] = (f"OMNIFLEET_WORKERS={cfg.workers}, OMNIFLEET_RESYNC_SECONDS={cfg.resync:g}, "
                                  f"OMNIFLEET_WATCH_TIMEOUT={cfg.watch_timeout}")
    dirty = subprocess.run(["git", "status", "--porcelain", "operator"], cwd=common.ROOT, capture_output=True,
                           text=True).stdout.split("\n")
    if cfg.experiment:
        facts["operator experiment (bench only)"] = cfg.experiment
    facts["operator code"] = "working tree" + (f" (uncommitted: {', '.join(l[3:] for l in dirty if l.strip())})"
                                               if any(l.strip() for l in dirty) else "")
    facts["load average at start"] = loadavg()
    per_pipeline = len(next(iter(prerender(pipeline_docs(1)).values())))

    root = Path(tempfile.mkdtemp(prefix="omnifleet-cp-bench-"))
    log(f"state dirs under {root}; sizes {cfg.sizes}; per-N limits "
        + ", ".join(f"{n}: {phase_limit(n):.0f}s" for n in cfg.sizes))

    def on_term(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    started = time.time()
    results: list[dict] = []
    json_path = cfg.results / f"{cfg.stamp}-control-plane{'-quick' if cfg.quick else ''}.json"
    try:
        for n in cfg.sizes:
            rounds = cfg.rounds_for(n)
            for rnd in range(1, rounds + 1):
                results.append(asyncio.run(run_size(n, cfg, root, per_pipeline, rnd, rounds)))
                json_path.write_text(json.dumps({"facts": facts, "results": results}, indent=1, default=str))
    except KeyboardInterrupt:
        log("interrupted: reporting what was measured")
    finally:
        left = leftover_processes(root)
        if left:
            log("WARNING: processes left running: " + "; ".join(left))
        if not cfg.keep_state:
            shutil.rmtree(root, ignore_errors=True)
    if not results:
        return 1
    facts["took_min"] = round((time.time() - started) / 60, 1)
    facts["load average at end"] = loadavg()
    json_path.write_text(json.dumps({"facts": facts, "results": results}, indent=1, default=str))
    report = write_report(results, cfg, facts, per_pipeline, started)
    if not cfg.quick and not cfg.no_latest:
        merge_latest(results, cfg, facts, report, prov)
    log(f"report: {report}")
    for k, v in headline(results).items():
        if "over" in k or "idle" in k:
            print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
