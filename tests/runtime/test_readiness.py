"""A stage pod's probes mean what the pipeline's status counts on, with real master and stage processes.

`/startedz`: every engine is loaded. `/readyz`: every worker of the pod is registered with
the master and takes work, so a Deployment's ready replicas are registered replicas.
The master's open `/ready` names, per stage, how many replicas it holds and the last
registration it refused, which the operator shows in the pipeline's status.
"""

from __future__ import annotations

import signal

import yaml

from fleet_harness import pipeline, stage, wait_until


def probes(fleet, pod: str) -> dict[str, int | None]:
    port = fleet.health_ports[pod]
    out = {}
    for path in ("/livez", "/startedz", "/readyz"):
        r = fleet.try_get(path, port=port)
        out[path] = None if r is None else r[0]
    return out


def test_a_stage_pod_is_ready_only_while_registered_with_the_master(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text")))
    pod = fleet.start_pod("pod-ab", "a", "b")  # a and b co-located: ready only when both are registered
    port = fleet.health_ports["pod-ab"]
    # No master yet: the engines load, the pod is started and alive, not ready.
    wait_until(lambda: probes(fleet, "pod-ab")["/startedz"] == 200, "the engines to load")
    status, body = fleet.get("/readyz", port=port)
    assert status == 503 and body["unregistered"] == ["a", "b"] and body["loading"] == []
    assert fleet.get("/livez", port=port)[0] == 200

    fleet.start_master()
    wait_until(lambda: fleet.try_get("/readyz", port=port) == (200, {"ready": True}), "the pod to be ready")
    assert fleet.get("/ready") == (200, {"ready": True, "stages": {
        "a": {"registered": 1, "routable": 1}, "b": {"registered": 1, "routable": 1}}})

    # The master dies: its connection closes, the pod is no longer one the master routes to.
    fleet.procs["master"].signal_group(signal.SIGKILL)
    fleet.procs["master"].popen.wait(timeout=10)
    # each worker notices on its own connection: both within the bound
    wait_until(lambda: (lambda r: r[0] == 503 and set(r[1]["unregistered"]) == {"a", "b"})(
        fleet.get("/readyz", port=port)), "the pod to turn unready, both workers unregistered", timeout=10)
    assert probes(fleet, "pod-ab")["/livez"] == 200  # alive: nothing to restart, its engines stay loaded

    fleet.start_master()
    wait_until(lambda: fleet.try_get("/readyz", port=port) == (200, {"ready": True}), "the pod to be ready again")
    assert pod.alive()


def test_a_replica_the_master_refuses_stays_unready_and_the_master_says_why(make_fleet, tmp_path):
    doc = pipeline(stage("a", "upper", finalOutput="text"))
    fleet = make_fleet(doc)
    fleet.start_master()
    fleet.start_pod("pod-good", "a")
    fleet.wait_ready()
    # A pod running another config of stage a (its output differs: another routing view).
    other = yaml.safe_load(fleet.config.read_text())
    other["spec"]["stages"][0]["finalOutput"] = "image"
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(other))
    fleet.start_pod("pod-old", "a", extra=("--config", str(old)))
    port = fleet.health_ports["pod-old"]

    def refusal():
        r = fleet.get("/ready")[1]["stages"]["a"].get("lastRefusal")
        return r and r["reason"]

    reason = wait_until(refusal, "the master to refuse the old pod")
    assert reason.startswith("config hash mismatch for stage 'a'"), reason
    status, body = fleet.get("/ready")
    assert status == 200 and body["stages"]["a"]["registered"] == 1  # the good replica serves on
    assert body["stages"]["a"]["lastRefusal"]["secondsAgo"] >= 0
    assert probes(fleet, "pod-old") == {"/livez": 200, "/startedz": 200, "/readyz": 503}
    assert fleet.get("/readyz", port=port)[1]["unregistered"] == ["a"]
    assert fleet.get("/readyz", port=fleet.health_ports["pod-good"]) == (200, {"ready": True})


def test_a_draining_pod_is_unready_at_once(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "gated_entry", finalOutput="text")))
    fleet.start_master()
    pod = fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    port = fleet.health_ports["pod-a"]
    assert fleet.get("/readyz", port=port) == (200, {"ready": True})
    pod.popen.send_signal(signal.SIGTERM)
    status, body = wait_until(lambda: (r := fleet.get("/readyz", port=port))[0] == 503 and r, "readyz to turn 503")
    assert body["draining"] is True
    assert pod.popen.wait(timeout=30) == 0


def test_a_new_master_is_ready_once_every_stage_registered_and_then_stays_ready(make_fleet):
    """The master pod's readiness (/readyz): a master just up takes no request through the Service until
    the stages found it; a stage lost later leaves it ready, so clients get the 503 naming the stage."""
    fleet = make_fleet(pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text")))
    fleet.start_master()
    wait_until(lambda: fleet.try_get("/health") is not None, "the master to listen")
    assert fleet.get("/readyz") == (503, {"ready": False, "waiting_for": ["a", "b"]})
    fleet.start_pod("pod-a", "a")
    wait_until(lambda: fleet.get("/readyz") == (503, {"ready": False, "waiting_for": ["b"]}), "a to register")
    b = fleet.start_pod("pod-b", "b")
    wait_until(lambda: fleet.get("/readyz") == (200, {"ready": True}), "the master to be ready")
    b.signal_group(signal.SIGTERM)
    wait_until(lambda: fleet.get("/ready")[0] == 503, "b to leave")
    assert fleet.get("/readyz") == (200, {"ready": True})
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "hi"})
    assert status == 503 and "b" in body["error"]["message"], body
