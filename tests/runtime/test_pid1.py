"""A pod's process is PID 1 of its container's PID namespace, and the kernel delivers SIGTERM to PID 1 only
through a handler: one that comes while the process still starts is dropped, unless the command takes it.

Here `omnifleet master|stage` runs as PID 1 of a PID namespace of its own (unshare, as root), as in a pod,
and gets SIGTERM every 20 ms from its start, as the kubelet sends it to a pod deleted as it starts (a
ReplicaSet scaled back at once). It must end before it serves anything; a process that ignored the early
signals went on to start (and only the signal after its own handler stopped it, after it had served).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet_harness import ROOT, free_port, pipeline, stage, wait_until

# What the `omnifleet` console script runs.
OMNIFLEET = [sys.executable, "-c", "import sys; from omnifleet_operator.cli import main; sys.exit(main())"]
SIGNAL_EVERY_S = 0.02
SIGNAL_FOR_S = 60.0


def _child(pid: int) -> int | None:
    """The process `unshare --fork` made: PID 1 of the new namespace."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    return int(children[0]) if children else None


@pytest.mark.parametrize("command", ["master", "stage"])
def test_a_pod_process_deleted_while_it_starts_ends_before_it_serves(make_fleet, command):
    fleet = make_fleet(pipeline(stage("echo", "echo", finalOutput="text")))
    common = ["--config", str(fleet.config), "--host", "127.0.0.1", "--keys-dir", str(fleet.keys_dir)]
    args = (["master", *common, "--api-port", str(fleet.api_port), "--control-port", str(fleet.control_port),
             "--admin-port", str(fleet.admin_port)] if command == "master" else
            ["stage", *common, "--master", fleet.master_arg, "--stage", "echo", "--data-port", "0",
             "--advertise-host", "127.0.0.1", "--health-port", str(free_port()), "--metrics-port", str(free_port())])
    log = fleet.dir / f"pid1-{command}.log"
    env = {**fleet.env, "OMNIFLEET_ADMIN_TOKEN": fleet.admin_token, "OMNIFLEET_POD_NAME": "echo-0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *OMNIFLEET, *args], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            pid1 = wait_until(lambda: _child(proc.pid) or proc.poll() is not None, "unshare's child", timeout=10,
                              step=0.001)
            assert pid1 is not True, f"unshare exited with {proc.returncode}: {log.read_text()}"
            nspid = next(line for line in Path(f"/proc/{pid1}/status").read_text().splitlines()
                         if line.startswith("NSpid:")).split()
            assert nspid[-1] == "1", f"not PID 1 of its namespace: {nspid}"
            deadline = time.monotonic() + SIGNAL_FOR_S
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    os.kill(pid1, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                time.sleep(SIGNAL_EVERY_S)
            assert proc.poll() is not None, f"still running after {SIGNAL_FOR_S:.0f}s of SIGTERM: {log.read_text()}"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, output
    # What each command logs once it runs: the master's API up, or the pod parent stopping its started workers.
    for started in (": API http://", "SIGTERM: draining", "stopping: draining the stage workers",
                    "[echo/"):
        assert started not in output, output
