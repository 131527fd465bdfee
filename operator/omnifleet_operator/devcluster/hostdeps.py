"""Debian packages the real node and the image builds need, installed when missing.

    containerd, runc          the container runtime (kubelet's CRI)
    containernetworking-plugins  CNI bridge, host-local, loopback, portmap
    iptables, ipset           kube-proxy's Service rules, kube-router's NetworkPolicy rules
    buildah                   builds the repo's Dockerfiles (no Docker engine here)
    mmdebstrap                the Debian root filesystem the local base images start from
    docker-registry           a registry on 127.0.0.1 while images move into containerd

Stdlib only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# package -> a file it installs (how we tell it is there)
PACKAGES = {
    "containerd": "containerd",
    "runc": "runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "iptables",
    "ipset": "ipset",
    "buildah": "buildah",
    "mmdebstrap": "mmdebstrap",
    "docker-registry": "docker-registry",
}


class HostDepsError(RuntimeError):
    pass


def missing() -> list[str]:
    def present(probe: str) -> bool:
        return Path(probe).exists() if probe.startswith("/") else shutil.which(probe) is not None
    return [pkg for pkg, probe in PACKAGES.items() if not present(probe)]


def ensure(say=print) -> None:
    todo = missing()
    if not todo:
        return
    if os.geteuid() != 0:
        raise HostDepsError(f"the real node needs these Debian packages, and installing them needs root: "
                            f"apt-get install {' '.join(todo)}")
    say(f"installing Debian packages: {' '.join(todo)} ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *todo]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode:
            raise HostDepsError(f"{' '.join(argv[:3])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    still = missing()
    if still:
        raise HostDepsError(f"still missing after apt-get install: {' '.join(still)}")


if __name__ == "__main__":
    try:
        ensure()
    except HostDepsError as e:
        print(f"hostdeps: {e}", file=sys.stderr)
        sys.exit(1)
