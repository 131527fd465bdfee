"""`omnifleet dev up --no-real-node|down|status` on a cluster of their own (a tmp state dir, never
the user's ~/.cache/omnifleet/dev). The default `dev up` (with the real node) and the `make run`
main job are tested in tests/realnode."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from omnifleet_operator.devcluster.cluster import COMPONENTS, _proc_start_time

from .kube import REPO


def omnifleet(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnifleet_operator.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def _pids(state: Path) -> dict[str, int]:
    out = {}
    for name in COMPONENTS:
        try:
            out[name] = int((state / "pids" / f"{name}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    try:
        out["operator"] = json.loads((state / "pids" / "operator.json").read_text())["pid"]
    except (OSError, ValueError):
        pass
    return out


def _alive(pid: int) -> bool:
    return _proc_start_time(pid) is not None


def test_dev_up_twice_status_and_down(tmp_path: Path):
    state = tmp_path / "dev"
    try:
        r = omnifleet("dev", "up", "--no-real-node", "--state-dir", str(state))
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.strip().splitlines()
        assert lines[-1] == f"export KUBECONFIG={state / 'admin.kubeconfig'}", lines
        assert "operator started" in r.stdout
        first = _pids(state)
        assert set(first) == {*COMPONENTS, "operator"} and all(map(_alive, first.values())), first

        # The operator is the ServiceAccount, and the in-cluster Deployment is scaled to 0.
        info = json.loads((state / "pids" / "operator.json").read_text())
        assert "sa-omnifleet-system-omnifleet-operator" in info["kubeconfig"]

        # Twice is harmless: everything is reused.
        r = omnifleet("dev", "up", "--no-real-node", "--state-dir", str(state))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "control plane already running" in r.stdout and "operator already running" in r.stdout
        assert _pids(state) == first
        assert r.stdout.strip().splitlines()[-1].startswith("export KUBECONFIG=")

        r = omnifleet("dev", "status", "--state-dir", str(state))
        assert r.returncode == 0 and "operator: running" in r.stdout and "control plane: running" in r.stdout, r.stdout

        running = _pids(state)
        r = omnifleet("dev", "down", "--state-dir", str(state))
        assert r.returncode == 0, r.stdout + r.stderr
        assert not [n for n, pid in running.items() if _alive(pid)], running

        r = omnifleet("dev", "status", "--state-dir", str(state))
        assert r.returncode == 1 and "not running" in r.stdout, r.stdout
        r = omnifleet("dev", "down", "--state-dir", str(state))  # harmless when already down
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if any(map(_alive, _pids(state).values())):
            omnifleet("dev", "down", "--state-dir", str(state))
