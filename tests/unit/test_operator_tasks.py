"""The operator's own tasks (elector, workers, resync, metrics adapter) run until cleanup: one that ends by
itself takes the process down, so that Kubernetes restarts the replica instead of keeping one that answers
its health check and reconciles nothing. Real processes: the exit is os._exit."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, sys
from omnifleet_operator import handlers

async def fails():
    await asyncio.sleep(0.05)
    raise ConnectionError("the API server went away")

async def runs():
    await asyncio.sleep(3600)

async def main():
    handlers._spawn(runs())
    if sys.argv[1] == "fails":
        handlers._spawn(fails())
    await asyncio.sleep(1.0)
    await handlers.cleanup()  # the operator's own shutdown: the tasks it cancels are no fault
    print("still running", flush=True)

asyncio.run(main())
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)


def test_a_task_that_fails_ends_the_process_saying_which():
    proc = _run("fails")
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "still running" not in proc.stdout
    assert "fails ended (ConnectionError('the API server went away'))" in proc.stderr, proc.stderr


def test_tasks_cancelled_at_cleanup_end_nothing():
    proc = _run("runs")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "still running"
