"""A rollout across stages, with real master and stage processes: each request runs through one revision.

The old revision's config runs `upper -> exclaim` ("Hi" -> "HI!"), the new one's `lower -> question`
("hi?"): a request routed through stages of both revisions would answer "hi!" or "HI?". The new stage a
comes up first and must wait (registered, not ready) until the new b registers; then new requests take
the new revision while the old replicas finish what they hold.
"""

from __future__ import annotations

import copy
import threading
import time

import yaml

from fleet_harness import pipeline, stage, wait_until

OLD, NEW = "HI!", "hi?"
LOOP_REQUESTS, LOOP_SECONDS, LOOP_PAUSE_S = 4000, 60.0, 0.01  # the client loop's bounds


def revisions(gen: int, a: str, b: str) -> dict:
    doc = pipeline(stage("a", a), stage("b", b, inputs=["a"], finalOutput="text"))
    doc["metadata"]["generation"] = gen
    return doc


def ask(fleet) -> str:
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "Hi"})
    assert status == 200, body
    return body["choices"][0]["text"]


class Loop(threading.Thread):
    """Requests one after another until stopped (bounded in count and time), keeping every answer."""

    def __init__(self, fleet):
        super().__init__(daemon=True)
        self.fleet, self.answers, self.errors = fleet, [], []
        self.halt = threading.Event()

    def run(self) -> None:
        end = time.monotonic() + LOOP_SECONDS
        while not self.halt.is_set() and len(self.answers) + len(self.errors) < LOOP_REQUESTS \
                and time.monotonic() < end:
            try:
                self.answers.append(ask(self.fleet))
            except AssertionError as e:
                self.errors.append(str(e))
            time.sleep(LOOP_PAUSE_S)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)


def readyz(fleet, pod: str) -> tuple[int, dict]:
    return fleet.get("/readyz", port=fleet.health_ports[pod])


def test_a_rollout_runs_each_request_through_one_revision_and_the_new_one_waits_for_every_stage(make_fleet,
                                                                                                 tmp_path):
    fleet = make_fleet(revisions(1, "upper", "exclaim"))
    fleet.start_master()
    fleet.start_pod("a-old", "a")
    fleet.start_pod("b-old", "b")
    fleet.wait_ready()
    assert ask(fleet) == OLD
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(revisions(2, "lower", "question")))
    loop = Loop(fleet)
    loop.start()

    fleet.start_pod("a-new", "a", extra=("--config", str(new)))
    wait_until(lambda: any(r["replica"] == "a-new" for r in fleet.stages()["a"]), "the new a to register")
    # Registered, and waiting: its revision has no b yet, so the old pods serve and the new one is not ready.
    wait_until(lambda: readyz(fleet, "a-new")[0] == 503, "the new a's readiness")
    status, body = readyz(fleet, "a-new")
    assert status == 503 and body["waitingForRevision"] == ["a"] and body["unregistered"] == [], body
    assert readyz(fleet, "a-old") == (200, {"ready": True})
    assert [ask(fleet) for _ in range(5)] == [OLD] * 5
    ready = fleet.get("/ready")
    assert ready[0] == 200 and len(ready[1]["stages"]["a"]["revisions"]) == 2, ready

    fleet.start_pod("b-new", "b", extra=("--config", str(new)))
    wait_until(lambda: ask(fleet) == NEW, "requests to take the new revision")
    wait_until(lambda: readyz(fleet, "a-new") == (200, {"ready": True}), "the new a to be ready")
    wait_until(lambda: readyz(fleet, "b-new") == (200, {"ready": True}), "the new b to be ready")
    # The old replicas get no new request: no longer ready, so a Deployment takes them down.
    wait_until(lambda: readyz(fleet, "a-old")[0] == 503 and readyz(fleet, "b-old")[0] == 503,
               "the old pods to leave readiness")
    assert [ask(fleet) for _ in range(5)] == [NEW] * 5
    loop.stop()
    assert not loop.errors, loop.errors[:3]
    seen = set(loop.answers)
    assert seen <= {OLD, NEW}, f"answers through stages of both revisions: {seen - {OLD, NEW}}"
    assert OLD in seen and NEW in seen, f"the loop saw only {seen} over {len(loop.answers)} answers"
    # The old pods go: the new revision serves alone.
    for pod in ("a-old", "b-old"):
        fleet.procs[pod].signal_group(15)
    wait_until(lambda: all(len(fleet.stages()[s]) == 1 for s in "ab"), "the old replicas to leave")
    assert fleet.get("/ready")[1]["stages"] == {"a": {"registered": 1, "routable": 1},
                                                "b": {"registered": 1, "routable": 1}}
    assert [ask(fleet) for _ in range(3)] == [NEW] * 3


def test_with_no_revision_whole_requests_wait_and_then_fail_naming_what_the_newest_lacks(make_fleet, tmp_path):
    fleet = make_fleet(revisions(1, "upper", "exclaim"))
    fleet.start_master("--replica-wait-timeout", "2")
    fleet.start_pod("a-old", "a")  # b has none: requests wait for one (the replica wait), then fail
    wait_until(lambda: fleet.try_get("/ready") is not None and len(fleet.stages()["a"]) == 1, "a to register")
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(revisions(2, "lower", "question")))
    fleet.start_pod("b-new", "b", extra=("--config", str(new)))
    wait_until(lambda: any(r["replica"] == "b-new" for r in fleet.stages()["b"]), "the new b to register")
    # Every stage has a replica, but of two revisions: nothing may mix them.
    status, body = fleet.get("/ready")
    assert status == 503 and "generation 2" in body["message"] and "stage(s) a" in body["message"], body
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "Hi"})
    assert status == 503, body
    assert "no revision of the pipeline had a replica of every stage" in body["error"]["message"], body
    # The new a arrives: the newest revision is whole, and serves.
    fleet.start_pod("a-new", "a", extra=("--config", str(new)))
    wait_until(lambda: fleet.try_get("/ready") is not None and fleet.get("/ready")[0] == 200, "the pipeline to be ready")
    assert ask(fleet) == NEW
