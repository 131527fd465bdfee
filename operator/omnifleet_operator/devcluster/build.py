"""Build the binaries of a real Kubernetes control plane from Go modules.

These machines have no Docker and no download sites, only the Go module
proxy, so etcd, the Kubernetes control plane, kubectl, kwok and a small
kstatus helper are compiled from source into a cache outside the repo:

    ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/kube/<versions-key>/bin/
    ${OMNIFLEET_CACHE:-~/.cache/omnifleet}/go/{mod,build}   (GOMODCACHE, GOCACHE)

A cold build took about 7 minutes on 2 cores (5.3 GB of Go caches); later
runs skip every component whose binary and stamp file are present. Stdlib only: this runs before any
virtualenv extras exist.

    python operator/omnifleet_operator/devcluster/build.py
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

KUBERNETES = "v1.36.3"  # released with Go 1.26, the pair of kwok v0.8.0
ETCD = "v3.6.16"  # kube-apiserver 1.34+ needs etcd 3.6 (watch progress requests)
KWOK = "v0.8.0"
CLI_UTILS = "v0.37.2"  # sigs.k8s.io/cli-utils, for the kstatus helper
COREDNS = "v1.12.4"
# The NetworkPolicy enforcer of the real node. kube-network-policies (kubernetes-sigs)
# queues packets with nftables' `queue` expression, which these machines' kernel lacks
# (CONFIG_NFT_QUEUE is off); kube-router's firewall needs only iptables and ipset.
KUBE_ROUTER = "v2.1.0"

VERSIONS_KEY = f"k8s-{KUBERNETES}_etcd-{ETCD}_kwok-{KWOK}"

KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy")
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "kstatus")
# The real worker node: kubelet, kube-proxy, cluster DNS, NetworkPolicy, the pod sandbox.
NODE = ("kubelet", "kube-proxy", "coredns", "kube-router", "pause")
COMPONENTS = (*CONTROL_PLANE, *NODE)

# kwok applies no default stages by itself; these are passed to it via --config.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)

BUILD_FLAGS = ("-p", "2", "-trimpath")
KUBE_TAGS = "selinux,notest,grpcnotrace"

KSTATUS_MAIN = """\
// kstatus reads one unstructured object as JSON on stdin and prints what
// sigs.k8s.io/cli-utils kstatus (used by Flux, kpt, ...) makes of its status.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	// apimachinery's json yields int64 numbers, as unstructured accessors
	// (metadata.generation, status.observedGeneration) expect; encoding/json
	// would give float64 and make Compute fail.
	var obj map[string]interface{}
	data, err := io.ReadAll(os.Stdin)
	if err == nil {
		err = utiljson.Unmarshal(data, &obj)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kstatus: decoding stdin:", err)
		os.Exit(2)
	}
	res, err := status.Compute(&unstructured.Unstructured{Object: obj})
	if err != nil {
		fmt.Fprintln(os.Stderr, "kstatus: compute:", err)
		os.Exit(1)
	}
	out := map[string]string{"status": string(res.Status), "message": res.Message}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
"""


class BuildError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("OMNIFLEET_CACHE") or Path.home() / ".cache" / "omnifleet")


def kube_dir() -> Path:
    return cache_root() / "kube" / VERSIONS_KEY


def bin_dir() -> Path:
    return kube_dir() / "bin"


def stages_dir() -> Path:
    return kube_dir() / "stages"


def stage_files() -> list[Path]:
    return [stages_dir() / Path(s).name for s in KWOK_STAGES]


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    root = cache_root() / "go"
    env.update(
        GOMODCACHE=str(root / "mod"),
        GOCACHE=str(root / "build"),
        GOWORK="off",  # never pick up a go.work from a parent directory
        CGO_ENABLED="0",  # static binaries, no C toolchain needed
        GOFLAGS="-buildvcs=false",
    )
    return env


def _log(msg: str) -> None:
    print(f"[devcluster.build] {msg}", file=sys.stderr, flush=True)


def _go(component: str, args: list[str], cwd: Path, log: Path) -> str:
    """Run one go command, appending its output to the component's log."""
    with log.open("a") as f:
        f.write(f"\n$ (cd {cwd}) go {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run(["go", *args], cwd=cwd, env=_go_env(), stdout=subprocess.PIPE, stderr=f, text=True)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(
            f"building {component} failed: go {' '.join(args[:2])} exited {proc.returncode} (full log: {log})\n{tail}"
        )
    return proc.stdout


def _write_module(d: Path, text: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "go.mod").write_text(text)


def _download_json(component: str, mod: str, src: Path, log: Path) -> dict:
    return json.loads(_go(component, ["mod", "download", "-json", mod], src, log))


# --- one function per wrapper module ----------------------------------------


def _build_etcd(src: Path, log: Path) -> None:
    # `go install` is refused (etcd's server go.mod has replace lines); a
    # wrapper module that requires it ignores those and builds its main package.
    pkg = "go.etcd.io/etcd/server/v3"
    _write_module(src, f"module omnifleet.local/etcd\n\ngo 1.26\n\nrequire {pkg} {ETCD}\n\ntool {pkg}\n")
    _go("etcd", ["mod", "tidy"], src, log)
    _go("etcd", ["build", *BUILD_FLAGS, "-ldflags=-s -w", "-o", str(bin_dir() / "etcd"), pkg], src, log)


def _kube_module(src: Path, log: Path) -> str:
    """Write the k8s.io/kubernetes wrapper module; return its -ldflags."""
    tools = "\n".join(KUBE_COMMANDS)
    if (src / "go.sum").exists() and (src / ".ldflags").exists() and _read(src / ".tools") == tools:
        return (src / ".ldflags").read_text()
    src.parent.mkdir(parents=True, exist_ok=True)
    info = _download_json("kubernetes", f"k8s.io/kubernetes@{KUBERNETES}", src.parent, log)
    gomod = json.loads(_go("kubernetes", ["mod", "edit", "-json", info["GoMod"]], src.parent, log))
    ver = KUBERNETES.removeprefix("v")
    major, minor = ver.split(".")[:2]
    staging_tag = f"v0.{minor}.{ver.split('.')[2]}"
    lines = [f"module omnifleet.local/kubernetes\n\ngo {gomod['Go']}\n"]
    # k8s.io/kubernetes points its staging modules at ./staging/src; outside its
    # repo each one must be replaced with its published v0.Y.Z tag. Read the
    # list from the real go.mod: it grows between releases.
    for r in gomod.get("Replace") or []:
        old, new = r["Old"]["Path"], r["New"]
        if new["Path"].startswith("./staging/"):
            lines.append(f"replace {old} => {old} {staging_tag}")
        elif new.get("Version"):
            lines.append(f"replace {old} => {new['Path']} {new['Version']}")
    for g in gomod.get("Godebug") or []:
        lines.append(f"godebug {g['Key']}={g['Value']}")
    lines.append(f"\nrequire k8s.io/kubernetes {KUBERNETES}\n")
    # tool lines keep the requirement (and its packages) through `go mod tidy`.
    lines += [f"tool k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS]
    _write_module(src, "\n".join(lines) + "\n")
    _go("kubernetes", ["mod", "tidy"], src, log)

    # Without the stamp the server reports v0.0.0-master and clients pick
    # wrong flags. buildDate is the release's commit time: reproducible.
    build_date = json.loads(Path(info["Info"]).read_text())["Time"]
    stamps = {
        "gitVersion": KUBERNETES,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    ldflags = "-s -w " + " ".join(
        f"-X {pkg}.{k}={v}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for k, v in stamps.items()
    )
    (src / ".ldflags").write_text(ldflags)
    (src / ".tools").write_text(tools)
    return ldflags


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _build_kube(name: str):
    def build(src: Path, log: Path) -> None:
        ldflags = _kube_module(src, log)
        _go(
            name,
            [
                "build",
                *BUILD_FLAGS,
                f"-tags={KUBE_TAGS}",
                f"-ldflags={ldflags}",
                "-o",
                str(bin_dir() / name),
                f"k8s.io/kubernetes/cmd/{name}",
            ],
            src,
            log,
        )

    return build


def _build_kwok(src: Path, log: Path) -> None:
    pkg = "sigs.k8s.io/kwok/cmd/kwok"
    _write_module(src, f"module omnifleet.local/kwok\n\ngo 1.26\n\nrequire sigs.k8s.io/kwok {KWOK}\n\ntool {pkg}\n")
    _go("kwok", ["mod", "tidy"], src, log)
    _go("kwok", ["build", *BUILD_FLAGS, "-ldflags=-s -w", "-o", str(bin_dir() / "kwok"), pkg], src, log)
    # The stage YAMLs ship in the module, not in the binary.
    mod_dir = Path(_download_json("kwok", f"sigs.k8s.io/kwok@{KWOK}", src, log)["Dir"])
    stages_dir().mkdir(parents=True, exist_ok=True)
    for rel in KWOK_STAGES:
        shutil.copyfile(mod_dir / "kustomize" / "stage" / rel, stages_dir() / Path(rel).name)


def _build_kstatus(src: Path, log: Path) -> None:
    _write_module(src, f"module omnifleet.local/kstatus\n\ngo 1.26\n\nrequire sigs.k8s.io/cli-utils {CLI_UTILS}\n")
    (src / "main.go").write_text(KSTATUS_MAIN)
    _go("kstatus", ["mod", "tidy"], src, log)
    _go("kstatus", ["build", *BUILD_FLAGS, "-ldflags=-s -w", "-o", str(bin_dir() / "kstatus"), "."], src, log)


COREDNS_MAIN = """\
// CoreDNS with only the plugins the dev cluster uses: the full build pulls about
// 1.2 GB of cloud SDK modules for plugins such as route53 and clouddns.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/template"
)

// The same relative order as CoreDNS's own plugin.cfg.
func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "cache", "template", "kubernetes"}
}

func main() { coremain.Run() }
"""

PAUSE_MAIN = """\
// pause: the pod sandbox's process (what registry.k8s.io/pause is). It sleeps,
// reaps orphans (it is PID 1 of the pod) and exits on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
"""


def _build_coredns(src: Path, log: Path) -> None:
    _write_module(src, f"module omnifleet.local/coredns\n\ngo 1.26\n\nrequire github.com/coredns/coredns {COREDNS}\n")
    (src / "main.go").write_text(COREDNS_MAIN)
    _go("coredns", ["mod", "tidy"], src, log)
    _go("coredns", ["build", *BUILD_FLAGS, "-ldflags=-s -w", "-o", str(bin_dir() / "coredns"), "."], src, log)


def _build_kube_router(src: Path, log: Path) -> None:
    pkg = "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
    _write_module(src, f"module omnifleet.local/kube-router\n\ngo 1.26\n\n"
                       f"require github.com/cloudnativelabs/kube-router/v2 {KUBE_ROUTER}\n\ntool {pkg}\n")
    _go("kube-router", ["mod", "tidy"], src, log)
    _go("kube-router", ["build", *BUILD_FLAGS, "-ldflags=-s -w", "-o", str(bin_dir() / "kube-router"), pkg], src, log)


def _build_pause(src: Path, log: Path) -> None:
    _write_module(src, "module omnifleet.local/pause\n\ngo 1.26\n")
    (src / "main.go").write_text(PAUSE_MAIN)
    _go("pause", ["build", *BUILD_FLAGS, "-ldflags=-s -w", "-o", str(bin_dir() / "pause"), "."], src, log)


_BUILDERS = {
    "etcd": ("etcd", _build_etcd, ETCD),
    **{c: ("kubernetes", _build_kube(c), KUBERNETES) for c in KUBE_COMMANDS},
    "kwok": ("kwok", _build_kwok, KWOK),
    "kstatus": ("kstatus", _build_kstatus, CLI_UTILS),
    "coredns": ("coredns", _build_coredns, COREDNS),
    "kube-router": ("kube-router", _build_kube_router, KUBE_ROUTER),
    "pause": ("pause", _build_pause, "1"),
}


def _recipe_hash(name: str, version: str) -> str:
    # A change of version, flags or helper source invalidates that component's stamp.
    extra = {"kwok": KWOK_STAGES, "kstatus": KSTATUS_MAIN, "coredns": COREDNS_MAIN, "pause": PAUSE_MAIN}.get(
        name, KUBE_TAGS if name in KUBE_COMMANDS else "")
    text = json.dumps([name, version, BUILD_FLAGS, extra])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_built(name: str, version: str) -> bool:
    stamp = bin_dir() / f".{name}.stamp"
    if not (bin_dir() / name).is_file() or not stamp.is_file():
        return False
    if name == "kwok" and not all(p.is_file() for p in stage_files()):
        return False
    return stamp.read_text().strip() == _recipe_hash(name, version)


@contextlib.contextmanager
def _lock():
    # Tests running in parallel may all call ensure_binaries(): build once.
    kube_dir().mkdir(parents=True, exist_ok=True)
    with (kube_dir() / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_binaries(verbose: bool = True, components: tuple[str, ...] = CONTROL_PLANE) -> dict[str, Path]:
    """Build whatever is missing of `components`; return {component name: binary path}.

    Build progress is always printed (a cold build takes many minutes);
    `verbose` adds the lines for components already up to date.
    """
    say = _log if verbose else (lambda _m: None)
    with _lock():
        bin_dir().mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        for name in components:
            module, builder, version = _BUILDERS[name]
            if _is_built(name, version):
                say(f"{name}: up to date")
                continue
            src = kube_dir() / "src" / module
            log = kube_dir() / "logs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("")
            if shutil.which("go") is None:
                raise BuildError(f"cannot build {name}: the `go` tool (1.26+) is not on PATH")
            _log(f"{name}: building {version} (log: {log}) ...")
            t0 = time.monotonic()
            builder(src, log)
            (bin_dir() / f".{name}.stamp").write_text(_recipe_hash(name, version) + "\n")
            _log(f"{name}: built in {time.monotonic() - t0:.0f}s")
        say(f"all binaries ready in {bin_dir()} ({time.monotonic() - start:.0f}s)")
    return {name: bin_dir() / name for name in components}


def main() -> int:
    try:
        ensure_binaries(components=COMPONENTS)
    except BuildError as e:
        _log(f"ERROR: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
