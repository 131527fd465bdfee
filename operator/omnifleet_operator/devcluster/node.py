"""The dev cluster's real worker node: containerd, kubelet, kube-proxy, CoreDNS, kube-router.

Each component is one process with the same shape as the control plane's
(`argv` to start it, `ready` to check it; DevCluster runs, waits for and
stops them, one log each). Versions: kubelet and kube-proxy of the control
plane's Kubernetes, built from Go modules like it; CoreDNS (a trimmed main)
and kube-router (its firewall only: the NetworkPolicy enforcer) from Go
modules too; containerd, runc and the CNI plugins from Debian (`hostdeps`).

What bit on these machines, and the settings that answer it:
- the VM withholds CAP_SYS_RESOURCE, so runc cannot lower oom_score_adj:
  containerd's `restrict_oom_score_adj`;
- cgroup v1 without systemd: kubelet's `failCgroupV1: false`, `cgroupDriver: cgroupfs`;
- `kubectl logs/exec` must not resolve the node name through the host's DNS:
  the apiserver prefers the node's InternalIP (set in cluster.py).

Images stay in containerd's root under the cache (`node_cache()`), so a new
`up` does not load them again. Stdlib only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import build, net

if TYPE_CHECKING:
    from .cluster import DevCluster

NODE_NAME = "omnifleet-node"
COMPONENTS = ("containerd", "kubelet", "kube-proxy", "coredns", "kube-router")
PAUSE_IMAGE = "localhost/omnifleet/pause:3.10"
NAMESPACE = "k8s.io"  # containerd namespace the CRI plugin uses
KUBELET_HEALTH_PORT = 10248
KUBE_PROXY_HEALTH = "127.0.0.1:10256"
KUBE_PROXY_METRICS = "127.0.0.1:10249"
COREDNS_HEALTH = "127.0.0.1:10254"
COREDNS_READY = "127.0.0.1:10255"
KUBE_ROUTER_HEALTH_PORT = 20244
# Users of the node's processes in the apiserver's token file: (user, groups).
NODE_USERS = {
    "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),  # Node authorizer + NodeRestriction
    "kube-proxy": ("system:kube-proxy", ""),  # bound to system:node-proxier by default
}


def node_cache() -> Path:
    return build.cache_root() / "node"


def containerd_root() -> Path:
    return node_cache() / "containerd"


def socket_path(state_dir: Path) -> Path:
    return state_dir / "run" / "containerd.sock"


def ctr(state_dir: Path, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`ctr` against the node's containerd, in the CRI's namespace."""
    proc = subprocess.run(["ctr", "--address", str(socket_path(state_dir)), "--namespace", NAMESPACE, *args],
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise RuntimeError(f"ctr {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for these paths


def write_configs(cluster: DevCluster, tokens: dict[str, str]) -> None:
    """Config files of every node component, in the cluster's state dir."""
    s = cluster.state_dir
    n = s / "node"
    for sub in ("cni", "kubelet", "pod-logs", "cni-ipam", "containerd-state"):
        (n / sub).mkdir(parents=True, exist_ok=True)
    socket_path(s).parent.mkdir(parents=True, exist_ok=True)
    containerd_root().mkdir(parents=True, exist_ok=True)
    (n / "cni" / "10-omnifleet.conflist").write_text(json.dumps(net.cni_config(n / "cni-ipam"), indent=2))
    (n / "containerd.toml").write_text(f"""\
version = 2
root = {_toml_str(str(containerd_root()))}
state = {_toml_str(str(n / "containerd-state"))}
[grpc]
  address = {_toml_str(str(socket_path(s)))}
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # runc cannot lower oom_score_adj without CAP_SYS_RESOURCE, which this VM withholds.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = {_toml_str(str(n / "cni"))}
""")
    for user in NODE_USERS:
        cluster.write_kubeconfig(n / f"{user}.kubeconfig", NODE_USERS[user][0], tokens[user])
    (n / "resolv.conf").write_text("")  # pods get cluster DNS only, not the host's search list
    (n / "kubelet.yaml").write_text(json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # these machines have cgroup v1 only
        "cgroupDriver": "cgroupfs",  # no systemd
        "containerRuntimeEndpoint": f"unix://{socket_path(s)}",
        "address": net.NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": KUBELET_HEALTH_PORT,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(cluster.ca_file)}},
        "authorization": {"mode": "Webhook"},
        "clusterDomain": "cluster.local",
        "clusterDNS": [net.NODE_IP],
        "resolvConf": str(n / "resolv.conf"),
        "podCIDR": net.POD_CIDR,
        "failSwapOn": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        # Images are loaded by hand, never pulled: do not collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # No disk-pressure eviction (as kind does): a developer's nearly full disk would taint the one node
        # and leave every pod Pending; the images and model are loaded once and never pulled again.
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                         "imagefs.available": "0%"},
        "serializeImagePulls": False,
        "podLogsDir": str(n / "pod-logs"),
        "shutdownGracePeriod": "0s",
    }, indent=2))
    (n / "kube-proxy.yaml").write_text(json.dumps({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(n / "kube-proxy.kubeconfig")},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": net.POD_CIDR,
        "nodePortAddresses": [f"{net.NODE_IP}/32"],  # never open NodePorts on the host's own interfaces
        "metricsBindAddress": KUBE_PROXY_METRICS,
        "healthzBindAddress": KUBE_PROXY_HEALTH,
        "iptables": {"localhostNodePorts": False},  # leaves route_localnet alone
        # 0: leave the host's conntrack sysctls as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }, indent=2))
    (n / "Corefile").write_text(f"""\
# Cluster names only; nothing is forwarded (no route leaves the bridge anyway).
cluster.local in-addr.arpa ip6.arpa {{
    bind {net.NODE_IP}
    errors
    health {COREDNS_HEALTH}
    ready {COREDNS_READY}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {cluster.kubeconfig} devcluster
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
. {{
    bind {net.NODE_IP}
    errors
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
""")


def argv(cluster: DevCluster, name: str, binaries: dict[str, Path]) -> list:
    n = cluster.state_dir / "node"
    if name == "containerd":
        return ["containerd", "--config", n / "containerd.toml"]
    if name == "kubelet":
        return [binaries["kubelet"], f"--config={n / 'kubelet.yaml'}", f"--kubeconfig={n / 'kubelet.kubeconfig'}",
                f"--root-dir={n / 'kubelet'}", f"--cert-dir={n / 'kubelet' / 'pki'}",
                f"--hostname-override={NODE_NAME}", f"--node-ip={net.NODE_IP}",
                "--node-labels=omnifleet.dev/node=real", "-v=1"]
    if name == "kube-proxy":
        return [binaries["kube-proxy"], f"--config={n / 'kube-proxy.yaml'}"]
    if name == "coredns":
        return [binaries["coredns"], "-conf", n / "Corefile"]
    if name == "kube-router":
        return [binaries["kube-router"], f"--kubeconfig={cluster.kubeconfig}", f"--hostname-override={NODE_NAME}",
                "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-cni=false",
                "--enable-ipv6=false", "--metrics-port=0", f"--health-port={KUBE_ROUTER_HEALTH_PORT}",
                "--iptables-sync-period=30s"]
    raise KeyError(name)


def check_ready(cluster: DevCluster, name: str) -> None:
    if name == "containerd":
        ctr(cluster.state_dir, "version", timeout=5)
    elif name == "kubelet":
        cluster.get(f"http://127.0.0.1:{KUBELET_HEALTH_PORT}/healthz")
    elif name == "kube-proxy":
        cluster.get(f"http://{KUBE_PROXY_HEALTH}/healthz")
    elif name == "coredns":
        cluster.get(f"http://{COREDNS_READY}/ready")
    elif name == "kube-router":
        cluster.get(f"http://127.0.0.1:{KUBE_ROUTER_HEALTH_PORT}/healthz")


def wait_node_ready(cluster: DevCluster) -> None:
    cluster.kubectl("wait", "--for=condition=Ready", f"node/{NODE_NAME}", f"--timeout={cluster.timeout:.0f}s",
                    timeout=cluster.timeout + 10)


def drain_pods(cluster: DevCluster) -> None:
    """Before stopping the node: orphan the controllers, then delete every pod fast.

    A cascading delete would give each pod its full grace period (120 s for a stage).
    """
    if not cluster.ready_quietly("kube-apiserver"):
        return
    k = cluster.kubectl
    k("delete", "deploy,rs,ds,sts,job", "--all", "-A", "--cascade=orphan", "--wait=false", check=False)
    k("delete", "pod", "--all", "-A", "--grace-period=1", "--wait=false", check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tasks = ctr(cluster.state_dir, "tasks", "ls", check=False, timeout=10)
        if tasks.returncode or "RUNNING" not in tasks.stdout:
            break
        time.sleep(0.5)


def teardown(cluster: DevCluster) -> None:
    """What the node left outside its processes: containers, mounts, netns, iptables, ipsets, cgroups."""
    s = cluster.state_dir
    if socket_path(s).exists():
        for task in ctr(s, "tasks", "ls", "-q", check=False, timeout=10).stdout.split():
            ctr(s, "tasks", "kill", "-s", "KILL", task, check=False, timeout=10)
    # Shims outlive containerd; their argv names our socket.
    sock = str(socket_path(s))
    for pid in _pids_with_arg(sock):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    kill_pod_processes()
    node_dir = str(s / "node")
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith((node_dir, str(containerd_root()), "/run/netns/cni-"))),
                    reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)
    for ns in Path("/run/netns").glob("cni-*") if Path("/run/netns").exists() else []:
        ns.unlink(missing_ok=True)
    kube_proxy = build.bin_dir() / "kube-proxy"
    if kube_proxy.exists():
        subprocess.run([str(kube_proxy), "--cleanup"], capture_output=True)
    net.remove_kube_chains()
    sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
    for name in sets:
        if name.startswith(("KUBE-", "kube-router")):
            subprocess.run(["ipset", "destroy", name], capture_output=True)
    for d in Path("/sys/fs/cgroup").glob("*/kubepods"):
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                sub.rmdir()
            except OSError:
                pass
        try:
            d.rmdir()
        except OSError:
            pass
    # State kubelet and libcni keep outside the state dir regardless of flags.
    for path in ("/var/lib/cni", "/var/log/pods", "/var/log/containers"):
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(s / "node" / "containerd-state", ignore_errors=True)
    shutil.rmtree(s / "node" / "kubelet", ignore_errors=True)
    shutil.rmtree(s / "node" / "cni-ipam", ignore_errors=True)


def kill_pod_processes() -> int:
    """SIGKILL every process left in the node's pod cgroups; how many.

    A container whose task containerd no longer lists (containerd stopped first, a shim killed) keeps
    running as an orphan in its pod's cgroup: seen with masters still serving after the node was gone.
    """
    n = 0
    for d in Path("/sys/fs/cgroup").glob("*/kubepods"):
        for procs in d.rglob("cgroup.procs"):
            try:
                pids = [int(x) for x in procs.read_text().split()]
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(pid, 9)
                    n += 1
                except ProcessLookupError:
                    pass
    return n


def _pids_with_arg(arg: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if arg in p.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0"):
                out.append(int(p.name))
        except OSError:
            continue
    return out


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
