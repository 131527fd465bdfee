"""Processes the dev tooling starts: tied to their owner, or deliberately detached (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ..conftest import REPO

# A process that owns a DevCluster, starts one component (a sleeper standing in for
# etcd & co.: the kill path is the same) and prints its pid.
OWNER = """
import sys, time
from omnifleet_operator.devcluster.cluster import DevCluster
c = DevCluster(sys.argv[1], owned=sys.argv[2] == "owned")
for sub in ("logs", "pids"):
    (c.state_dir / sub).mkdir(parents=True, exist_ok=True)
c._start("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
print(c._procs["sleeper"].pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int, timeout: float) -> bool:
    for _ in range(int(timeout / 0.05)):
        try:
            state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _owner_then_kill(tmp_path, mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator")])}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path), mode], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        pid = int(owner.stdout.readline())
    finally:
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait(timeout=10)
    return pid


def test_an_owned_cluster_dies_with_its_owner(tmp_path):
    pid = _owner_then_kill(tmp_path, "owned")
    assert _gone(pid, timeout=10), "a component outlived the process that owned the cluster"


def test_a_dev_up_cluster_outlives_the_command_that_started_it(tmp_path):
    pid = _owner_then_kill(tmp_path, "detached")
    try:
        assert not _gone(pid, timeout=1), "`omnifleet dev up` must leave its cluster running for `dev down`"
    finally:
        os.killpg(pid, signal.SIGKILL)  # own session: the component is its group's leader
