"""`omnifleet dev up|down|status|images`: a local cluster with the operator running in it.

`up` builds what is missing (the Kubernetes binaries from Go modules, the
Debian packages of the node, the repo's images), starts the DevCluster with
its real node in the default state dir (${OMNIFLEET_CACHE:-~/.cache/omnifleet}/dev),
adds two fake 8-GPU nodes (kwok; tainted `nvidia.com/gpu`, so only GPU pods
go there), loads the images into the node's containerd and installs the
operator with `kubectl apply -k manifests/`: the operator runs in the
cluster, from its own image, as its least-privilege ServiceAccount. Its last
line is `export KUBECONFIG=...` (the admin kubeconfig). Running it again reuses
what runs and restarts only what died; `dev images` rebuilds and reloads the
images (cached layers: seconds after a source change). `down` stops
everything. `status` says what runs (exit 0 only when all does).

`up --no-real-node` is the older, lighter shape: the control plane with fake
nodes only (plus a CPU-only one), the in-cluster operator scaled to 0 and the
operator as a local process authenticating as the same ServiceAccount.

The pieces (`install`, `OperatorProcess`, ...) are also used by the
end-to-end tests and by the `make run` main job. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from omnifleet_runtime.lifetime import parent_death_preexec

from . import build, hostdeps, images, node
from ..ports import spare_port
from .cluster import DevCluster, DevClusterError, _proc_start_time, _tail, default_state_dir

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "manifests"
OPERATOR_NAMESPACE = "omnifleet-system"
OPERATOR_SA = "omnifleet-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
CRD_NAME = "omnipipelines.omnifleet.dev"
# (name, GPUs): what `up` and the tests start with; a 16-GPU node is what a test adds later.
NODES = (("gpu-0", 8), ("gpu-1", 8), ("cpu-0", 0))
# Beside the real node (which runs the CPU pods) only fake GPU nodes, tainted as GPU pools are.
GPU_NODES = (("gpu-0", 8), ("gpu-1", 8))
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OPERATOR_ROLLOUT_TIMEOUT_S = 180
LIVENESS_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def say(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


# -- install ---------------------------------------------------------------------

def add_nodes(cluster: DevCluster, nodes=NODES, taints: list | None = None) -> list[str]:
    """Create the fake nodes that do not exist yet; return the names created."""
    made = []
    for name, gpus in nodes:
        if cluster.kubectl("get", "node", name, check=False).returncode:
            cluster.add_node(name, gpus=gpus, taints=taints if gpus else None)
            made.append(name)
    return made


def install(cluster: DevCluster, manifests: Path = MANIFESTS, *, in_cluster: bool = False) -> None:
    """`kubectl apply -k manifests/` and wait for the CRD.

    in_cluster: wait until the operator Deployment (its own image) is rolled
    out on the real node. Otherwise scale it to 0: on fake nodes it would run
    nothing, and the operator runs as a local process instead.
    """
    cluster.kubectl("apply", "-k", str(manifests))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=70)
    if in_cluster:
        # HPAs get their metrics from the operator's pods; without them (fake nodes) an APIService
        # nobody serves would stall namespace deletion and garbage collection.
        cluster.kubectl("apply", "-k", str(manifests / "autoscaling"))
        # A rebuilt image under the same tag: restart so the pod runs what was just loaded.
        cluster.kubectl("rollout", "restart", f"deployment/{OPERATOR_SA}", "-n", OPERATOR_NAMESPACE)
        wait_rollout(cluster, OPERATOR_NAMESPACE, OPERATOR_SA, OPERATOR_ROLLOUT_TIMEOUT_S)
    else:
        cluster.kubectl("scale", "deployment", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--replicas=0")


def wait_rollout(cluster: DevCluster, namespace: str, name: str, timeout: float) -> None:
    """`kubectl rollout status`, with the pods' state in the error when it does not finish."""
    r = cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", namespace, f"--timeout={timeout:.0f}s",
                        check=False, timeout=timeout + 15)
    if r.returncode:
        pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        events = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
        raise DevClusterError(f"deployment {namespace}/{name} did not roll out in {timeout:.0f}s: "
                              f"{r.stderr.strip()}\n{pods}\n{events[-3000:]}")


def weights_volume(namespace: str, claim: str = "omni-weights", path: str = "/var/lib/omnifleet/models",
                   size: str = "100Gi") -> list[dict]:
    """A static hostPath PersistentVolume and a claim bound to it (what a modelVolume needs).

    storageClassName "" on both keeps any default StorageClass out; claimRef and
    volumeName pin the pair to each other.
    """
    pv_name = f"{namespace}-{claim}"
    pv = {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": pv_name, "labels": {"omnifleet.dev/demo-volume": "true"}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": path, "type": "DirectoryOrCreate"},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": pv_name,
            "resources": {"requests": {"storage": size}},
        },
    }
    return [pv, pvc]


class PortForward:
    """`kubectl port-forward -n NS TARGET PORT:REMOTE` in the background, on 127.0.0.1."""

    def __init__(self, cluster: DevCluster, namespace: str, target: str, remote: int, port: int = 0,
                 timeout: float = 30):
        self.port = port or free_port()
        argv = [cluster._bin("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "port-forward", "-n", namespace,
                "--address=127.0.0.1", target, f"{self.port}:{remote}"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        first = self.proc.stdout.readline() if self.proc.stdout else ""
        while "Forwarding from" not in first:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                rest = self.proc.stdout.read() if self.proc.poll() is not None and self.proc.stdout else ""
                self.stop()
                raise DevClusterError(f"kubectl port-forward {target} failed: {first}{rest}".strip())
            first = self.proc.stdout.readline()
        # Drain its output so a full pipe never blocks it.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the operator as a local process -----------------------------------------------

def free_port() -> int:
    return spare_port()


def operator_argv(liveness_url: str, extra: list[str] = ()) -> list[str]:
    # A free port for /metrics: several local operators (tests, benchmarks) must not collide.
    return [sys.executable, "-m", "omnifleet_operator.cli", "operator", "--liveness", liveness_url,
            "--metrics-port", str(free_port()), *extra]


def operator_env(kubeconfig: Path, **settings: str | int | float) -> dict[str, str]:
    """The operator's environment: its kubeconfig plus OMNIFLEET_* settings (resync_seconds=3, ...)."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    for key, value in settings.items():
        env[f"OMNIFLEET_{key.upper()}"] = str(value)
    return env


def is_live(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_live(url: str, proc_alive, log: Path, timeout: float = LIVENESS_TIMEOUT_S) -> None:
    """Wait for the operator's liveness endpoint; fail early (with its log) if it exits."""
    deadline = time.monotonic() + timeout
    while not is_live(url):
        if not proc_alive():
            raise DevClusterError(f"the operator exited during start-up; log {log}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise DevClusterError(f"the operator's liveness {url} did not answer in {timeout:.0f}s; "
                                  f"log {log}:\n{_tail(log)}")
        time.sleep(0.2)


class OperatorProcess:
    """The operator running in the background from a state dir: pidfile, log, liveness URL."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)

    @property
    def info_file(self) -> Path:
        return self.state_dir / "pids" / "operator.json"

    @property
    def log(self) -> Path:
        return self.state_dir / "logs" / "operator.log"

    def info(self) -> dict | None:
        try:
            return json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        """The pid from the pidfile if that very process is still alive (not a reused pid)."""
        info = self.info()
        if not info:
            return None
        return info["pid"] if _proc_start_time(info["pid"]) == info["start"] else None

    @property
    def liveness_url(self) -> str | None:
        info = self.info()
        return info["liveness"] if info else None

    def is_running(self) -> bool:
        url = self.liveness_url
        return self.pid() is not None and url is not None and is_live(url)

    def start(self, cluster: DevCluster, **settings) -> int:
        kubeconfig = cluster.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA)
        url = f"http://127.0.0.1:{free_port()}/healthz"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.info_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            # Own session: a Ctrl-C in the terminal that ran `dev up` does not reach it.
            proc = subprocess.Popen(operator_argv(url), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=operator_env(kubeconfig, **settings),
                                    cwd=self.state_dir, start_new_session=True,
                                    preexec_fn=parent_death_preexec(signal.SIGTERM) if cluster.owned else None)
        self.info_file.write_text(json.dumps({"pid": proc.pid, "start": _proc_start_time(proc.pid),
                                              "liveness": url, "kubeconfig": str(kubeconfig)}))
        try:
            wait_live(url, lambda: proc.poll() is None, self.log)
        except BaseException:
            self.stop()
            raise
        return proc.pid

    def stop(self) -> int | None:
        """SIGTERM its process group, SIGKILL after a grace period; the pid stopped, if any."""
        pid = self.pid()
        if pid is not None:
            _killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while _proc_start_time(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if _proc_start_time(pid) is not None:
                _killpg(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while _proc_start_time(pid) is not None and time.monotonic() < deadline:
                    time.sleep(0.05)
        self.info_file.unlink(missing_ok=True)
        return pid


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# -- the commands --------------------------------------------------------------------

def up(state_dir: Path | None = None, real_node: bool = True, owned: bool = False) -> DevCluster:
    """Start (or reuse) cluster, nodes, images, install and operator. Raises on failure.

    owned: what this starts dies with the calling process (`make run`); else it
    outlives it until `dev down` (`omnifleet dev up`). A reused cluster keeps its own.
    """
    state_dir = Path(state_dir or default_state_dir()).resolve()
    if real_node:
        return up_real(state_dir, owned)
    say("checking the Kubernetes binaries (a first build takes several minutes) ...")
    build.ensure_binaries(verbose=True)
    cluster = DevCluster(state_dir, real_node=False, owned=owned)
    op = OperatorProcess(state_dir)
    if cluster.is_running():
        say(f"control plane already running at {cluster.apiserver_url}")
    else:
        # An operator left from a dead cluster talks to nothing; up() also wipes the state dir.
        if op.stop() is not None:
            say("stopped an operator left from a previous cluster")
        say(f"starting the control plane in {state_dir} ...")
        cluster.up()
        say(f"control plane up at {cluster.apiserver_url} in {cluster.up_seconds:.1f}s")
    made = add_nodes(cluster)
    if made:
        say(f"added fake nodes: {', '.join(made)}")
    say(f"installing the operator: kubectl apply -k {MANIFESTS} (CRD, RBAC, namespace, Deployment) ...")
    install(cluster)
    say(f"scaled the in-cluster operator Deployment to 0 (kwok pods run nothing); "
        f"the operator runs locally as {OPERATOR_USER}")
    if op.is_running():
        say(f"operator already running (pid {op.pid()}, log {op.log})")
    else:
        if op.stop() is not None:
            say("stopped an operator that did not answer its liveness probe")
        pid = op.start(cluster)
        say(f"operator started (pid {pid}, liveness {op.liveness_url}, log {op.log})")
    return cluster


def up_real(state_dir: Path, owned: bool = False) -> DevCluster:
    t0 = time.monotonic()
    say("checking the Debian packages of the node (containerd, runc, CNI, iptables, ipset, buildah, ...) ...")
    hostdeps.ensure(say)
    say("checking the Kubernetes binaries: control plane and node (a first build takes about 10 minutes) ...")
    build.ensure_binaries(verbose=False, components=build.COMPONENTS)
    cluster = DevCluster(state_dir, real_node=True, owned=owned)
    stale = OperatorProcess(state_dir)
    if stale.stop() is not None:
        say("stopped a local operator left from a cluster without the real node")
    if cluster.is_running() and cluster.real_node:
        say(f"cluster already running at {cluster.apiserver_url}")
    else:
        say(f"starting the control plane and the real node {node.NODE_NAME} in {state_dir} ...")
        cluster.up()
        say(f"cluster up at {cluster.apiserver_url} in {cluster.up_seconds:.1f}s "
            f"(node {node.NODE_NAME} Ready; logs in {state_dir / 'logs'})")
    made = add_nodes(cluster, GPU_NODES, taints=[GPU_TAINT])
    if made:
        say(f"added fake GPU nodes (kwok, tainted {GPU_TAINT['key']}): {', '.join(made)}")
    say("building the images (a first build takes several minutes; then cached) and loading them into the node ...")
    images.ensure(state_dir, say)
    say(f"installing the operator: kubectl apply -k {MANIFESTS}; waiting for its pod on {node.NODE_NAME} ...")
    install(cluster, in_cluster=True)
    say(f"operator running in the cluster ({OPERATOR_NAMESPACE}/{OPERATOR_SA}); all up in {time.monotonic() - t0:.0f}s")
    return cluster


def build_images(state_dir: Path | None = None) -> None:
    """Build the images; when the dev cluster with its real node runs, load them and restart the operator."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    hostdeps.ensure(say)
    cluster = DevCluster(state_dir)
    if cluster.is_running() and cluster.real_node:
        images.ensure(state_dir, say)
        install(cluster, in_cluster=True)
        say("images loaded into the node; the operator restarted on its new image "
            "(restart pipelines' pods to run the new runtime image: kubectl rollout restart deploy -n NS)")
    else:
        ids = images.build_all(say)
        say("built " + ", ".join(ids) + " (no dev cluster running: nothing loaded)")


def down(state_dir: Path | None = None) -> None:
    state_dir = Path(state_dir or default_state_dir()).resolve()
    op = OperatorProcess(state_dir)
    pid = op.stop()
    say(f"operator stopped (pid {pid})" if pid else "operator not running")
    cluster = DevCluster(state_dir)
    was = cluster.is_running()
    cluster.down()
    say("control plane stopped" if was else "control plane stopped (was not fully running)")


def status(state_dir: Path | None = None) -> bool:
    state_dir = Path(state_dir or default_state_dir()).resolve()
    cluster = DevCluster(state_dir)
    op = OperatorProcess(state_dir)
    running = cluster.is_running()
    if running:
        print(f"control plane: running at {cluster.apiserver_url} (state {state_dir})")
        nodes = cluster.kubectl("get", "nodes", "--no-headers", "-o", "custom-columns=N:.metadata.name",
                                check=False).stdout.split()
        print(f"nodes: {', '.join(nodes) or 'none'}")
        pipes = cluster.kubectl("get", "omnipipelines", "-A", "--no-headers", check=False)
        count = len(pipes.stdout.splitlines()) if pipes.returncode == 0 else 0
        print(f"pipelines: {count}")
    else:
        print(f"control plane: not running (state {state_dir})")
    if running and cluster.real_node:
        print(f"real node: {node.NODE_NAME} ({', '.join(node.COMPONENTS)} running)")
        r = cluster.kubectl("get", "deployment", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "-o",
                            "jsonpath={.status.availableReplicas}", check=False)
        available = int(r.stdout or 0) if r.returncode == 0 else 0
        print(f"operator: {'running' if available else 'not available'} in the cluster "
              f"({OPERATOR_NAMESPACE}/{OPERATOR_SA}, {available} available)")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        return available > 0
    pid = op.pid()
    if pid and op.is_running():
        print(f"operator: running (pid {pid}, liveness {op.liveness_url}, log {op.log})")
    elif pid:
        print(f"operator: pid {pid} alive but its liveness {op.liveness_url} does not answer (log {op.log})")
    else:
        print("operator: not running")
    if running:
        print(f"export KUBECONFIG={cluster.kubeconfig}")
    return running and pid is not None and op.is_running()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="omnifleet dev", description="A local Kubernetes cluster (control plane, "
                                "a real node, fake GPU nodes) with the operator running in it.")
    p.add_argument("action", choices=("up", "down", "status", "images"))
    p.add_argument("--state-dir", type=Path, default=None,
                   help=f"where pidfiles, logs and kubeconfigs live (default: {default_state_dir()})")
    p.add_argument("--no-real-node", action="store_true",
                   help="control plane and fake nodes only; the operator as a local process")
    args = p.parse_args(argv)
    try:
        if args.action == "up":
            cluster = up(args.state_dir, real_node=not args.no_real_node)
            print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        elif args.action == "images":
            build_images(args.state_dir)
        elif args.action == "down":
            down(args.state_dir)
        else:
            return 0 if status(args.state_dir) else 1
    except (DevClusterError, build.BuildError, images.ImageError, hostdeps.HostDepsError, OSError,
            subprocess.TimeoutExpired) as e:
        print(f"omnifleet dev {args.action}: {e}", file=sys.stderr)
        return 1
    return 0
