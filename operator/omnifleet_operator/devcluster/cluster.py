"""A real Kubernetes control plane, envtest-style, for tests and the dev loop; optionally a real node.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (which
plays kubelet for fake nodes and pods) run as local processes built by
build.py. Everything lives in one state directory (pidfiles, logs, certs,
kubeconfigs), so `up` twice reuses the running cluster and `down` stops all
it started.

Two shapes:
- `DevCluster(dir)`: the control plane on 127.0.0.1 with free ports; many can
  run at once (tests do). The pod and Service IPs kwok hands out are
  bookkeeping and never routed.
- `DevCluster(dir, real_node=True)`: the same plus one real worker node
  (node.py: containerd, kubelet, kube-proxy, CoreDNS, kube-router) on a
  bridge this machine creates (net.py, 198.18.0.0/15 only). The apiserver
  binds the bridge address so pods reach it through the `kubernetes`
  Service. One at a time: the bridge and the node's ports are the machine's.

    with DevCluster(tmp_path) as c:
        c.add_node("gpu-0", gpus=8)
        c.kubectl("get", "nodes")

Dev loop:  python operator/omnifleet_operator/devcluster/cluster.py up|down|status
(state in ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/dev/). Stdlib only (and the
runtime's stdlib-only `lifetime`).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from omnifleet_operator.ports import spare_port
from omnifleet_runtime.lifetime import parent_death_preexec

if __package__:
    from . import build, net, node
else:  # run as a script: the script's directory is on sys.path
    import build  # type: ignore[no-redef]
    import net  # type: ignore[no-redef]
    import node  # type: ignore[no-redef]

# Start order; `down` stops in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
STOP_GRACE_S = 10.0
# HPAs with minReplicas 0 (stages that scale to zero): beta and on by default from Kubernetes 1.37.
FEATURE_GATES = "HPAScaleToZero=true"
FRONT_PROXY_CLIENT = "front-proxy-client"  # the CN the aggregation layer's client cert carries
NODE_LEASE_SECONDS = 40  # kwok renews each fake node's Lease (what kwokctl sets by default)
# Log every write once (at ResponseComplete), nothing else.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted", "Panic"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}


class DevClusterError(RuntimeError):
    pass


def default_state_dir() -> Path:
    return build.cache_root() / "dev"


def kstatus(obj: dict) -> dict:
    """What sigs.k8s.io/cli-utils kstatus (Flux's health check) makes of an object."""
    exe = build.ensure_binaries(verbose=False)["kstatus"]
    out = subprocess.run([exe], input=json.dumps(obj), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _proc_start_time(pid: int) -> str | None:
    """Start time of a live process (guards against PID reuse); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # zombie: reap it if it is our child
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return None
    return fields[19]


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise DevClusterError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def _make_certs(d: Path, host: str = "127.0.0.1") -> None:
    """A CA, the apiserver's serving cert, its client cert for kubelets, and the service-account key."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=omnifleet-devcluster-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        "-subj",
        "/CN=kube-apiserver",
        cwd=d,
    )
    (d / "apiserver.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,IP:{host},IP:{net.KUBERNETES_SERVICE_IP},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n"
        # Explicit key identifiers: strict verifiers (Python 3.13+) require them.
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        "apiserver.ext",
        "-out",
        "apiserver.crt",
        cwd=d,
    )
    # The apiserver's client identity towards kubelets (logs, exec, port-forward).
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr",
             "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client", cwd=d)
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-extfile", "client.ext", "-out", "kubelet-client.crt", cwd=d)
    # The aggregation layer: the apiserver proxies custom.metrics.k8s.io to the operator's adapter with
    # this client cert, from a CA of its own (the adapter trusts only it, as a front proxy).
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-keyout", "front-proxy-ca.key",
             "-out", "front-proxy-ca.crt", "-subj", "/CN=omnifleet-devcluster-front-proxy-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "front-proxy-client.key", "-out",
             "front-proxy-client.csr", "-subj", f"/CN={FRONT_PROXY_CLIENT}", cwd=d)
    _openssl("x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt", "-CAkey",
             "front-proxy-ca.key", "-CAcreateserial", "-days", "3650", "-extfile", "client.ext", "-out",
             "front-proxy-client.crt", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


class DevCluster:
    def __init__(self, state_dir: str | os.PathLike | None = None, *, timeout: float = 90.0,
                 real_node: bool | None = None, owned: bool = False):
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.timeout = timeout  # per component readiness
        self._real_node = real_node  # None: as the running cluster in state_dir was started
        # owned: the processes die with this one however it dies (a test session, `make run`);
        # else they outlive it, as `omnifleet dev up` means, and `dev down` stops them by pidfile.
        self.owned = owned
        self._info: dict | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self.up_seconds: float | None = None  # start-up time of the last fresh up()

    # --- paths and connection details --------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def _info_file(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def info(self) -> dict:
        if self._info is None:
            if not self._info_file.exists():
                raise DevClusterError(f"no cluster in {self.state_dir}: call up() first")
            self._info = json.loads(self._info_file.read_text())
        return self._info

    @property
    def real_node(self) -> bool:
        if self._real_node is None:
            try:
                return bool(self.info.get("real_node"))
            except DevClusterError:
                return False
        return self._real_node

    @property
    def host(self) -> str:
        """Where the apiserver listens: the bridge address with a real node, else loopback."""
        return net.NODE_IP if self.real_node else "127.0.0.1"

    @property
    def components(self) -> tuple[str, ...]:
        return COMPONENTS + (node.COMPONENTS if self.real_node else ())

    @property
    def apiserver_url(self) -> str:
        return f"https://{self.host}:{self.info['ports']['apiserver']}"

    @property
    def admin_token(self) -> str:
        return self.info["token"]

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "pki" / "ca.crt"

    def _bin(self, name: str) -> str:
        return str(build.bin_dir() / name)

    def _log(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def _pidfile(self, name: str) -> Path:
        return self.state_dir / "pids" / f"{name}.pid"

    # --- lifecycle ------------------------------------------------------------

    def __enter__(self) -> DevCluster:
        self.owned = True
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def is_running(self) -> bool:
        """All processes from the state dir alive and every component ready."""
        if not self._info_file.exists() or not all(self._pid(n) for n in self.components):
            return False
        try:
            for name in self.components:
                self._check_ready(name)
        except Exception:
            return False
        return True

    def up(self) -> DevCluster:
        wanted = build.CONTROL_PLANE + (build.NODE if self._real_node else ())
        binaries = build.ensure_binaries(verbose=False, components=wanted)
        if self.is_running() and self.real_node == bool(self._real_node):
            return self
        self.down()  # a half-dead previous cluster: stop whatever is left
        if self._real_node:
            self._claim_node()
        started = time.monotonic()
        for attempt in range(3):
            # Fresh state each time: a kept etcd data dir would remember old ports.
            if self.state_dir.exists():
                shutil.rmtree(self.state_dir)
            for sub in ("logs", "pids", "pki", "kwok-home"):
                (self.state_dir / sub).mkdir(parents=True)
            try:
                self._start_all(binaries)
                break
            except DevClusterError as e:
                self.down()
                # A free port picked at start can be taken by someone else
                # before the component binds it (parallel tests): pick again.
                if "address already in use" not in str(e) or attempt == 2:
                    raise
            except BaseException:
                self.down()
                raise
        self.up_seconds = time.monotonic() - started
        return self

    def _claim_node(self) -> None:
        """One real node per machine: refuse when another state dir's node runs."""
        owner = node.node_cache() / "owner"
        if owner.exists() and (other := Path(owner.read_text().strip())) != self.state_dir:
            if DevCluster(other, real_node=True).is_running():
                raise DevClusterError(f"a dev cluster with the real node already runs from {other}: "
                                      f"stop it first (omnifleet dev down --state-dir {other})")
        owner.parent.mkdir(parents=True, exist_ok=True)
        owner.write_text(str(self.state_dir))

    def _start_all(self, binaries: dict[str, Path]) -> None:
        s, pki = self.state_dir, self.state_dir / "pki"
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        ports = dict(zip(names, (spare_port() for _ in names), strict=True))
        real = bool(self._real_node)
        if real:
            net.up(s)  # the apiserver binds the bridge address
            ports["apiserver"] = 6443
        tokens = {"admin": secrets.token_hex(24)} | {u: secrets.token_hex(24) for u in node.NODE_USERS} if real \
            else {"admin": secrets.token_hex(24)}
        self._info = {"ports": ports, "token": tokens["admin"], "real_node": real}
        _make_certs(pki, self.host)
        (s / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        lines = [f'{tokens["admin"]},admin,admin,"system:masters"']
        lines += [f'{tokens[c]},{u},{u},"{g}"' if g else f"{tokens[c]},{u},{u}"
                  for c, (u, g) in node.NODE_USERS.items() if c in tokens]
        (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
        self._info_file.write_text(json.dumps(self._info, indent=2))
        if real:
            apiserver_net = [
                f"--bind-address={self.host}", f"--advertise-address={self.host}",
                # Kubelets are reached by IP: the node name means nothing to the host's DNS.
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                # The aggregation layer (APIServices such as custom.metrics.k8s.io), dialing the
                # serving pods' endpoint IPs directly rather than through a Service IP.
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--enable-aggregator-routing=true",
            ]
        else:
            apiserver_net = [
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",  # else it looks for a default route
                "--endpoint-reconciler-type=none",  # no real endpoint for the kubernetes Service
                "--authorization-mode=RBAC",
            ]

        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        self._start(
            "etcd",
            [
                binaries["etcd"],
                "--name=default",
                f"--data-dir={s / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync",  # throwaway data: fsync only slows tests down
                "--log-level=warn",
            ],
        )
        self._wait_ready("etcd")

        self._start(
            "kube-apiserver",
            [
                binaries["kube-apiserver"],
                f"--etcd-servers={etcd_url}",
                *apiserver_net,
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                # Client certs signed by our CA (also the CSR signer's) authenticate too.
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={net.SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--allow-privileged=true",
                f"--feature-gates={FEATURE_GATES}",
                # Who wrote what: tests count an operator's writes from this log.
                f"--audit-policy-file={s / 'audit-policy.json'}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
            ],
        )
        self._wait_ready("kube-apiserver")
        self.write_kubeconfig(self.kubeconfig, "admin", self.admin_token)

        kc = str(self.kubeconfig)
        # Delegated authn/authz lets /metrics on these servers accept the admin token.
        # Skip-lookup: token review is all we use; reading client-cert/request-header
        # CAs from the extension-apiserver-authentication ConfigMap only logs errors.
        delegated = [
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--authentication-skip-lookup=true",
        ]
        self._start(
            "kube-controller-manager",
            [
                binaries["kube-controller-manager"],
                f"--kubeconfig={kc}",
                *delegated,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['controller-manager']}",
                f"--feature-gates={FEATURE_GATES}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",  # published as kube-root-ca.crt
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                f"--service-cluster-ip-range={net.SERVICE_CIDR}",
                # The defaults (20/30) throttle scale tests.
                "--kube-api-qps=200",
                "--kube-api-burst=400",
            ],
        )
        # The scheduler's --kube-api-qps flags are deprecated: use its config file.
        sched_cfg = s / "scheduler.yaml"
        sched_cfg.write_text(
            json.dumps(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": kc, "qps": 200, "burst": 400},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        self._start(
            "kube-scheduler",
            [
                binaries["kube-scheduler"],
                f"--config={sched_cfg}",
                *delegated,
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
            ],
        )
        self._start(
            "kwok",
            [
                binaries["kwok"],
                f"--kubeconfig={kc}",
                # Only nodes marked fake (add_node does): never the real node.
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--cidr={net.FAKE_POD_CIDR}",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{ports['kwok']}",
                # The heartbeat-with-lease stage patches node status only every
                # few minutes and relies on a node Lease for liveness: without
                # one the node lifecycle controller declares every node
                # not-Ready after ~40 s and marks their pods not-Ready.
                f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
                # kwok applies no stages by itself: node-initialize, heartbeat, pod lifecycle.
                *(f"--config={p}" for p in build.stage_files()),
            ],
            env={"HOME": str(s / "kwok-home")},  # else it reads ~/.kwok/kwok.yaml
        )
        for name in COMPONENTS[2:]:
            self._wait_ready(name)
        # Pods are refused until the ServiceAccount controller made `default`.
        self._wait(
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            "kube-controller-manager",
            "the default ServiceAccount",
        )
        if real:
            self._start_node(binaries, tokens)

    def _start_node(self, binaries: dict[str, Path], tokens: dict[str, str]) -> None:
        node.write_configs(self, tokens)
        for name in node.COMPONENTS:
            self._start(name, node.argv(self, name, binaries))
            self._wait_ready(name)
            if name == "kubelet":
                self._wait(lambda: self.kubectl("get", "node", node.NODE_NAME, check=False).returncode == 0,
                           "kubelet", "the node to register")
        node.wait_node_ready(self)

    def stop_node_component(self, name: str) -> None:
        """Stop one of the real node's processes (SIGTERM, SIGKILL after a grace period), nothing else:
        what a crashed kubelet or container runtime leaves behind (its pods' containers keep running)."""
        if not self.real_node or name not in node.COMPONENTS:
            raise DevClusterError(f"{name!r} is not a process of this cluster's real node")
        self._stop([name])

    def start_node_component(self, name: str) -> None:
        """Start a stopped node process again, as up() started it, and wait until it is ready."""
        if not self.real_node or name not in node.COMPONENTS:
            raise DevClusterError(f"{name!r} is not a process of this cluster's real node")
        if self._pid(name):
            raise DevClusterError(f"{name} is already running")
        binaries = build.ensure_binaries(verbose=False, components=build.NODE)
        self._start(name, node.argv(self, name, binaries))
        self._wait_ready(name)

    def down(self) -> None:
        """Stop every process of this state dir: SIGTERM, then SIGKILL after a grace period."""
        real = self.real_node or bool(self._real_node)
        if real:
            node.drain_pods(self)
            self._stop(list(reversed(node.COMPONENTS)))
            node.teardown(self)
        # etcd last: an apiserver that loses etcd first hangs in its graceful shutdown.
        self._stop([n for n in COMPONENTS if n != "etcd"])
        self._stop(["etcd"])
        self._procs.clear()
        if real:
            net.down(self.state_dir)
        # Keep logs, certs and kubeconfigs for post-mortems; etcd data is the bulk.
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)

    def _stop(self, names: list[str]) -> None:
        alive = {n: pid for n in names if (pid := self._pid(n))}
        for pid in alive.values():
            self._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while alive and time.monotonic() < deadline:
            alive = {n: p for n, p in alive.items() if self._alive(n, p)}
            time.sleep(0.05)
        for pid in alive.values():
            self._signal(pid, signal.SIGKILL)
        for name, pid in alive.items():
            for _ in range(100):
                if not self._alive(name, pid):
                    break
                time.sleep(0.05)
            else:
                raise DevClusterError(f"{name} (pid {pid}) survived SIGKILL")
        for name in names:
            self._pidfile(name).unlink(missing_ok=True)

    # --- processes ------------------------------------------------------------

    def _start(self, name: str, argv: list, env: dict | None = None) -> None:
        with self._log(name).open("ab") as log:
            # Own session = own process group: down() can kill the whole group,
            # and a Ctrl-C in the dev loop's terminal does not reach it.
            proc = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=parent_death_preexec(signal.SIGTERM) if self.owned else None,
            )
        self._procs[name] = proc
        self._pidfile(name).write_text(f"{proc.pid} {_proc_start_time(proc.pid)}\n")

    def _pid(self, name: str) -> int | None:
        """PID from the pidfile if that very process is still alive."""
        try:
            pid_s, start = self._pidfile(name).read_text().split()
        except (OSError, ValueError):
            return None
        return int(pid_s) if _proc_start_time(int(pid_s)) == start else None

    def _alive(self, name: str, pid: int) -> bool:
        proc = self._procs.get(name)
        if proc is not None:
            return proc.poll() is None
        return _proc_start_time(pid) is not None

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    # --- readiness ------------------------------------------------------------

    def get(self, url: str, *, token: str | None = None, verify: bool = True, timeout: float = 5) -> str:
        if url.startswith("https"):
            ctx = ssl.create_default_context(cafile=str(self.ca_file)) if verify else ssl._create_unverified_context()
        else:
            ctx = None
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as r:
            return r.read().decode()

    def ready_quietly(self, name: str) -> bool:
        try:
            self._check_ready(name)
        except Exception:
            return False
        return True

    def _check_ready(self, name: str) -> None:
        if name in node.COMPONENTS:
            node.check_ready(self, name)
            return
        p = self.info["ports"]
        if name == "etcd":
            body = self.get(f"http://127.0.0.1:{p['etcd']}/health")
            if '"health":"true"' not in body.replace(" ", ""):
                raise DevClusterError(body)
        elif name == "kube-apiserver":
            self.get(f"{self.apiserver_url}/readyz", token=self.admin_token)
        elif name == "kube-controller-manager":
            # Self-signed in-memory serving certs: nothing to verify against.
            self.get(f"https://127.0.0.1:{p['controller-manager']}/healthz", verify=False)
        elif name == "kube-scheduler":
            self.get(f"https://127.0.0.1:{p['scheduler']}/readyz", verify=False)
        elif name == "kwok":
            self.get(f"http://127.0.0.1:{p['kwok']}/healthz")

    def _wait_ready(self, name: str) -> None:
        def ready() -> bool:
            self._check_ready(name)
            return True

        self._wait(ready, name, "readiness")

    def _wait(self, predicate, name: str, what: str) -> None:
        deadline, last = time.monotonic() + self.timeout, None
        while True:
            pid = self._pid(name)
            if pid is None or not self._alive(name, pid):
                raise DevClusterError(
                    f"{name} exited during start-up; log {self._log(name)}:\n{_tail(self._log(name))}"
                )
            try:
                if predicate():
                    return
            except (OSError, urllib.error.URLError, RuntimeError, ssl.SSLError, subprocess.TimeoutExpired) as e:
                last = e
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"{name}: timed out after {self.timeout:.0f}s waiting for {what}"
                    f" (last error: {last}); log {self._log(name)}:\n{_tail(self._log(name))}"
                )
            time.sleep(0.2)

    # --- API helpers ------------------------------------------------------------

    def write_kubeconfig(self, path: Path, user: str, token: str) -> Path:
        # JSON is valid YAML; the CA is inlined so the file can be copied anywhere.
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "devcluster",
                    "clusters": [
                        {
                            "name": "devcluster",
                            "cluster": {"server": self.apiserver_url, "certificate-authority-data": ca},
                        }
                    ],
                    "users": [{"name": user, "user": {"token": token}}],
                    "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": user}}],
                },
                indent=2,
            )
        )
        path.chmod(0o600)
        return path

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster (admin by default); raise with stderr on failure."""
        argv = [
            self._bin("kubectl"),
            f"--kubeconfig={kubeconfig or self.kubeconfig}",
            # Own discovery cache: another cluster may have had the same port.
            f"--cache-dir={self.state_dir / 'kubectl-cache'}",
            *args,
        ]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise DevClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    @property
    def audit_log(self) -> Path:
        return self.state_dir / "logs" / "audit.jsonl"

    def writes(self, user: str | None = None, since_line: int = 0) -> list[dict]:
        """Write requests (create/update/patch/delete) from the audit log, optionally of one user."""
        try:
            text = self.audit_log.read_text()
        except OSError:
            return []
        # The apiserver may be writing the last line right now: only complete lines count.
        lines = text.split("\n")[:-1][since_line:]
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if user is None or e.get("user", {}).get("username") == user]

    def audit_lines(self) -> int:
        """The audit log's length now: pass it as `since_line` to count later writes only."""
        try:
            return self.audit_log.read_text().count("\n")  # complete lines, as writes() reads them
        except OSError:
            return 0

    def metrics(self) -> str:
        """The apiserver's Prometheus /metrics, read with the admin token."""
        return self.get(f"{self.apiserver_url}/metrics", token=self.admin_token, timeout=30)

    def sa_kubeconfig(self, namespace: str, sa: str, duration: str = "24h") -> Path:
        """A kubeconfig authenticating as ServiceAccount namespace/sa (created if missing)."""
        made = self.kubectl("create", "serviceaccount", sa, "-n", namespace, check=False)
        if made.returncode and "already exists" not in made.stderr.lower():
            raise DevClusterError(f"creating ServiceAccount {namespace}/{sa}: {made.stderr.strip()}")
        token = self.kubectl("create", "token", sa, "-n", namespace, f"--duration={duration}").stdout.strip()
        return self.write_kubeconfig(
            self.state_dir / f"sa-{namespace}-{sa}.kubeconfig", f"system:serviceaccount:{namespace}:{sa}", token
        )

    def add_node(
        self,
        name: str,
        gpus: int = 8,
        cpu: str = "64",
        memory: str = "512Gi",
        pods: int = 110,
        labels: dict | None = None,
        taints: list | None = None,
        wait: bool = True,
    ) -> dict:
        """Create a fake Node that kwok keeps Ready; a scale-up by the autoscaler, simulated.

        The scheduler counts extended resources such as nvidia.com/gpu from the
        Node's status alone: no device plugin needed. A Node's status may be
        set on create (not on update), which is why it is in the manifest.
        """
        resources = {"cpu": cpu, "memory": memory, "pods": str(pods)}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                # kwok's conventional marker; --manage-all-nodes manages it regardless.
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "type": "kwok",
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **({"nvidia.com/gpu.present": "true"} if gpus else {}),
                    **(labels or {}),
                },
            },
            "spec": {"taints": taints or []},
            "status": {"capacity": resources, "allocatable": dict(resources)},
        }
        self.kubectl("create", "-f", "-", input=json.dumps(node))
        if wait:
            self.kubectl(
                "wait",
                "--for=condition=Ready",
                f"node/{name}",
                f"--timeout={self.timeout:.0f}s",
                timeout=self.timeout + 10,
            )
        return node

    def remove_node(self, name: str) -> None:
        self.kubectl("delete", "node", name, "--ignore-not-found")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="omnifleet dev control plane (etcd, apiserver, kwok ...)")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--state-dir", type=Path, default=default_state_dir())
    args = p.parse_args(argv)
    c = DevCluster(args.state_dir)
    try:
        if args.action == "up":
            c.up()
            print(f"export KUBECONFIG={c.kubeconfig}")
        elif args.action == "down":
            c.down()
        else:
            running = c.is_running()
            print(f"running: {c.apiserver_url}" if running else "not running")
            return 0 if running else 1
    except (DevClusterError, build.BuildError) as e:
        print(f"devcluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
