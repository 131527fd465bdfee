"""`omnifleet dev up|down|status`: a local control plane with the operator running.

`up` builds the binaries when missing, starts the DevCluster in the default
state dir (${OMNIFLEET_CACHE:-~/.cache/omnifleet}/dev), adds fake nodes (two
with 8 GPUs, one CPU-only), installs the operator with `kubectl apply -k
manifests/`, scales the in-cluster operator Deployment to 0 (kwok pods run
nothing) and starts the real operator as a local background process that
authenticates as the omnifleet-operator ServiceAccount, so the shipped RBAC is
what it gets. Its last line is `export KUBECONFIG=...` (the admin kubeconfig).
Running it again reuses what runs and restarts only what died. `down` stops the
operator, then the cluster. `status` says what runs (exit 0 only when all does).

The pieces (`install`, `start_operator`, `stop_operator`, ...) are also used by
the end-to-end tests and by the `make run` main job. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import build
from .cluster import DevCluster, DevClusterError, _proc_start_time, _tail, default_state_dir

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "manifests"
OPERATOR_NAMESPACE = "omnifleet-system"
OPERATOR_SA = "omnifleet-operator"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
CRD_NAME = "omnipipelines.omnifleet.dev"
# (name, GPUs): what `up` and the tests start with; a 16-GPU node is what a test adds later.
NODES = (("gpu-0", 8), ("gpu-1", 8), ("cpu-0", 0))
LIVENESS_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def say(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


# -- install ---------------------------------------------------------------------

def add_nodes(cluster: DevCluster, nodes=NODES) -> list[str]:
    """Create the fake nodes that do not exist yet; return the names created."""
    made = []
    for name, gpus in nodes:
        if cluster.kubectl("get", "node", name, check=False).returncode:
            cluster.add_node(name, gpus=gpus)
            made.append(name)
    return made


def install(cluster: DevCluster, manifests: Path = MANIFESTS) -> None:
    """`kubectl apply -k manifests/`, wait for the CRD, scale the in-cluster operator to 0.

    kwok pods run nothing, so the in-cluster operator Deployment could never do
    its job here: the real operator runs as a local process instead.
    """
    cluster.kubectl("apply", "-k", str(manifests))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s", timeout=70)
    cluster.kubectl("scale", "deployment", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--replicas=0")


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


# -- the operator as a local process -----------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operator_argv(liveness_url: str, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "omnifleet_operator.cli", "operator", "--liveness", liveness_url, *extra]


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
                                    cwd=self.state_dir, start_new_session=True)
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

def up(state_dir: Path | None = None) -> DevCluster:
    """Start (or reuse) cluster, nodes, install and operator. Raises on failure."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    say("checking the Kubernetes binaries (a first build takes several minutes) ...")
    build.ensure_binaries(verbose=True)
    cluster = DevCluster(state_dir)
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
    p = argparse.ArgumentParser(prog="omnifleet dev", description="A local Kubernetes control plane "
                                "(etcd, kube-apiserver, kwok fake nodes) with the operator running.")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--state-dir", type=Path, default=None,
                   help=f"where pidfiles, logs and kubeconfigs live (default: {default_state_dir()})")
    args = p.parse_args(argv)
    try:
        if args.action == "up":
            cluster = up(args.state_dir)
            print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        elif args.action == "down":
            down(args.state_dir)
        else:
            return 0 if status(args.state_dir) else 1
    except (DevClusterError, build.BuildError, subprocess.TimeoutExpired) as e:
        print(f"omnifleet dev {args.action}: {e}", file=sys.stderr)
        return 1
    return 0
