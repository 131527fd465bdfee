"""Engine start timeout and engine death inside a live pod, with real stage processes.

The python engine stands in for vLLM here (tests/engines kills a real vLLM engine core): its
stage module starts a helper process that plays the engine process, and reports its death
through `omnifleet_dead()`.
"""

from __future__ import annotations

import os
import signal
import threading

from fleet_harness import pipeline, stage, wait_until


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by its (gone) parent is a zombie: count it as dead
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def start_loading(make_fleet, tmp_path, **fields):
    """A stage pod whose engine load takes 120 s, once the load has started its helper process: (the pod,
    the helper's pid)."""
    doc = pipeline(stage("slow", "answer", finalOutput="text", **fields))
    doc["spec"]["stages"][0]["entrypoint"] = "lifecyclefns:answer"
    fleet = make_fleet(doc)
    fleet.env["LIFECYCLE_HANG_ON_LOAD"] = "1"
    fleet.start_master()
    pod = fleet.start_pod("pod-slow", "slow")
    pid_file = tmp_path / "helper-pod-slow.pid"
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the load to start its helper process")
    return pod, int(pid_file.read_text())


def test_engine_that_does_not_start_in_time_is_stopped_and_the_stage_exits(make_fleet, tmp_path):
    pod, helper_pid = start_loading(make_fleet, tmp_path, engineStartTimeoutSeconds=2)
    wait_until(lambda: not pod.alive(), "the stage pod to give up", timeout=60)
    assert pod.popen.returncode == 4, pod.output()
    assert "stage slow failed to start: its engine did not start within 2s (engineStartTimeoutSeconds)" \
        in pod.output()
    wait_until(lambda: not pid_alive(helper_pid), "the engine's helper process to be killed", timeout=10)


def test_a_pod_stopped_while_its_engine_loads_stops_at_once(make_fleet, tmp_path):
    """SIGTERM (a pod deleted) during a load that would take 120 s: the pod exits 0 without finishing it,
    and the engine's own process goes with it."""
    pod, helper_pid = start_loading(make_fleet, tmp_path)
    os.kill(pod.pid, signal.SIGTERM)  # as the kubelet stops a pod: its main process
    wait_until(lambda: not pod.alive(), "the stage pod to stop", timeout=60)  # the load alone takes 120 s
    assert pod.popen.returncode == 0, pod.output()
    assert "SIGTERM while the engine starts: stopping (nothing to drain)" in pod.output()
    wait_until(lambda: not pid_alive(helper_pid), "the engine's helper process to be killed", timeout=10)


def test_a_stage_stuck_after_its_drain_is_killed_with_its_stacks_logged(make_fleet):
    """A thread that never ends holds the worker's exit after a clean drain: past --exit-timeout the pod
    logs the worker's stacks (naming where it waits) and kills it, instead of waiting for the kubelet's
    SIGKILL at the end of the grace period."""
    doc = pipeline(stage("stuck", "answer", finalOutput="text"))
    doc["spec"]["stages"][0]["entrypoint"] = "lifecyclefns:answer"
    fleet = make_fleet(doc)
    fleet.env["LIFECYCLE_THREAD_HOLDS_EXIT"] = "1"
    fleet.start_master()
    pod = fleet.start_pod("pod-stuck", "stuck", extra=("--drain-timeout", "1", "--exit-timeout", "3"))
    fleet.wait_ready()
    os.kill(pod.pid, signal.SIGTERM)
    wait_until(lambda: not pod.alive(), "the stuck stage pod to be stopped", timeout=60)
    out = pod.output()
    assert "drained; exiting" in out  # the drain itself ran and ended
    assert "stage(s) ['stuck'] still running 3s after their drain deadline (--exit-timeout)" in out, out
    assert "in hold_exit" in out and "lifecyclefns.py" in out, out  # faulthandler's dump names the thread's frame
    assert pod.popen.returncode == 1, out


def test_engine_death_deregisters_the_replica_and_its_request_fails_over(make_fleet, tmp_path):
    doc = pipeline(stage("eng", "answer", finalOutput="text", replicas=2))
    doc["spec"]["stages"][0]["entrypoint"] = "lifecyclefns:answer"
    fleet = make_fleet(doc)
    fleet.start_master()
    a = fleet.start_pod("pod-a", "eng")
    b = fleet.start_pod("pod-b", "eng")
    fleet.wait_ready()

    result = {}
    caller = threading.Thread(target=lambda: result.update(
        out=fleet.openai().completions.create(model="test", prompt="hello")))
    caller.start()
    first = wait_until(lambda: next((p for p in ("pod-a", "pod-b") if (tmp_path / f"inflight-{p}").exists()),
                                    None), "the request to reach a replica")
    other = "pod-b" if first == "pod-a" else "pod-a"
    dying, surviving = (a, b) if first == "pod-a" else (b, a)
    os.kill(int((tmp_path / f"engine-{first}.pid").read_text()), 9)  # the engine process dies mid-request

    wait_until(lambda: not dying.alive(), "the pod with the dead engine to exit", timeout=30)
    assert dying.popen.returncode == 5, dying.output()
    assert "stage eng: engine died: engine process" in dying.output()
    # the master dropped the replica at once and sent the request to the other one
    wait_until(lambda: [r["replica"] for r in fleet.stages()["eng"]] == [other], "the replica to deregister")
    assert "deregistered: engine died" in fleet.procs["master"].output()
    wait_until(lambda: (tmp_path / f"inflight-{other}").exists(), "the request to fail over")
    (tmp_path / "release").touch()
    caller.join(timeout=30)
    assert result["out"].choices[0].text == f"{other}:hello"
    assert surviving.alive()


def test_a_pod_whose_engine_died_is_neither_live_nor_ready_while_it_stops(make_fleet, tmp_path):
    """eng's engine dies; the pod stops, its co-located stage side draining a request meanwhile:
    all that time its probes say so (liveness fails: Kubernetes restarts it, as the exit does too)."""
    doc = pipeline(stage("a", "upper"),
                   stage("eng", "answer", inputs=["a"], finalOutput="text"),
                   stage("side", "gated_entry", inputs=["a"], finalOutput="audio", colocateWith="eng"))
    doc["spec"]["stages"][1]["entrypoint"] = "lifecyclefns:answer"
    fleet = make_fleet(doc)
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    pod = fleet.start_pod("pod-x", "eng", "side", extra=("--drain-timeout", "60"))
    fleet.wait_ready()
    port = fleet.health_ports["pod-x"]
    assert fleet.get("/readyz", port=port) == (200, {"ready": True})

    def side_request():  # only side's output: eng takes no part in it; its answer does not matter here
        try:
            fleet.http("POST", "/v1/chat/completions", {"model": "test", "modalities": ["audio"],
                                                         "messages": [{"role": "user", "content": "x"}]})
        except OSError:
            pass

    caller = threading.Thread(target=side_request, daemon=True)
    caller.start()
    wait_until(lambda: list(tmp_path.glob("started-*-pod-x")), "side to hold a request")
    os.kill(int((tmp_path / "engine-pod-x.pid").read_text()), 9)

    wait_until(lambda: "eng" not in {s for s, reps in fleet.stages().items() if reps}, "eng to deregister")
    assert pod.alive()  # side drains its request
    status, body = fleet.get("/livez", port=port)
    assert status == 503 and body["dead"] == ["stage-eng"]
    status, body = fleet.get("/readyz", port=port)
    assert status == 503 and body["dead"] == ["stage-eng"]
    # The pod noticed eng's exit and stops; side finishes what it holds meanwhile, the probes unchanged.
    wait_until(lambda: fleet.get("/readyz", port=port)[1]["draining"], "the pod to stop")
    assert pod.alive() and fleet.get("/livez", port=port)[0] == 503
    (tmp_path / "gate").touch()
    assert pod.popen.wait(timeout=30) == 5, pod.output()
    caller.join(timeout=30)
