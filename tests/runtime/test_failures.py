"""Replicas and the master die, restart and drain; no request is lost or hangs."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time

import openai
import pytest

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import constants as C
from omnifleet_runtime.api import RETRY_AFTER_S

LOST_AFTER_STREAMING = "was lost after output was streamed"


async def test_kill_one_of_two_replicas_under_load(make_fleet):
    """200 requests, 20 at a time; one of two replicas of the streaming final stage is killed.

    The first 20 requests each stream a first chunk naming their replica and
    then stall on a gate, so at the kill the test knows exactly which
    requests the victim holds after streaming: those, and only those, fail
    with the error event; every other request completes.
    """
    fleet = make_fleet(pipeline(
        stage("a", "upper"),
        stage("b", "first_then_gate", inputs=["a"], replicas=2, finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b1", "b")
    fleet.start_pod("pod-b2", "b")
    fleet.wait_ready()

    client = fleet.async_openai()
    first_chunks: dict[int, str] = {}
    outcomes: dict[int, str] = {}
    todo = iter(range(200))

    async def one(i: int) -> None:
        text = ""
        try:
            stream = await client.completions.create(model="test", prompt=f"r{i}", stream=True)
            async for chunk in stream:
                text += chunk.choices[0].text
                first_chunks.setdefault(i, chunk.choices[0].text)
            assert text in ("[pod-b1]done", "[pod-b2]done"), text
            outcomes[i] = "ok"
        except openai.APIError as e:
            assert LOST_AFTER_STREAMING in e.message, e.message
            outcomes[i] = "lost"

    async def worker() -> None:
        for i in todo:
            await one(i)

    workers = [asyncio.create_task(worker()) for _ in range(20)]
    for _ in range(1500):  # bounded: until all 20 first requests have streamed their first chunk
        if len(first_chunks) == 20:
            break
        await asyncio.sleep(0.02)
    assert len(first_chunks) == 20
    held_by_victim = {i for i, c in first_chunks.items() if c == "[pod-b1]"}
    assert held_by_victim  # the two replicas shared the load
    fleet.procs["pod-b1"].signal_group(signal.SIGKILL)
    (fleet.dir / "gate").touch()
    await asyncio.wait_for(asyncio.gather(*workers), 60)

    assert len(outcomes) == 200
    assert {i for i, o in outcomes.items() if o == "lost"} == held_by_victim
    assert sum(o == "ok" for o in outcomes.values()) == 200 - len(held_by_victim)
    assert fleet.metric("omnifleet_requests_total", outcome="replica_lost") == len(held_by_victim)
    assert fleet.metric("omnifleet_stage_replicas", stage="b") == 1


def test_lost_replica_before_streaming_is_redispatched(make_fleet):
    fleet = make_fleet(pipeline(
        stage("a", "gated_entry", replicas=2),
        stage("b", "echo", inputs=["a"], finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("pod-a1", "a")
    fleet.start_pod("pod-a2", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()

    results: dict[int, str] = {}

    def call(i: int) -> None:
        out = fleet.openai().completions.create(model="test", prompt=f"p{i}")
        results[i] = out.choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: len(list(fleet.dir.glob("started-*"))) == 6, "6 requests to start in stage a")
    on_victim = len(list(fleet.dir.glob("started-*-pod-a1")))
    assert on_victim > 0
    fleet.procs["pod-a1"].signal_group(signal.SIGKILL)
    (fleet.dir / "gate").touch()
    for t in threads:
        t.join(timeout=30)

    assert results == {i: f"p{i}@pod-a2" for i in range(6)}  # all done, the victim's ones elsewhere
    assert fleet.metric("omnifleet_redispatches_total", stage="a") == on_victim


def upper_exclaim_fleet(make_fleet):
    """Stages a (upper) -> b (exclaim), one pod each, ready; and an openai client."""
    fleet = make_fleet(pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()
    return fleet, fleet.openai()


def test_master_restart_stages_reregister_without_reloading(make_fleet):
    fleet, client = upper_exclaim_fleet(make_fleet)
    assert client.completions.create(model="test", prompt="one").choices[0].text == "ONE!"
    loads = (fleet.dir / "loads.log").read_text()
    assert len(loads.splitlines()) == 2  # one engine load per stage process

    fleet.procs["master"].signal_group(signal.SIGKILL)
    fleet.procs["master"].popen.wait(timeout=10)
    assert fleet.try_get("/health") is None
    fleet.start_master()  # same ports, new process, no memory of the stages
    fleet.wait_ready()
    assert client.completions.create(model="test", prompt="two").choices[0].text == "TWO!"
    assert (fleet.dir / "loads.log").read_text() == loads  # engines were not rebuilt
    assert fleet.procs["pod-a"].alive() and fleet.procs["pod-b"].alive()
    for pod in ("pod-a", "pod-b"):
        # Noticed by the closed connection, not after the heartbeat timeout.
        assert "master session ended (the master's connection closed); registering again" \
            in fleet.procs[pod].output()


def test_sigterm_drains_in_flight_work_and_exits_zero(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "gated_entry", finalOutput="text")))
    fleet.start_master()
    pod = fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    health = fleet.health_ports["pod-a"]
    assert fleet.get("/readyz", port=health) == (200, {"ready": True})
    assert fleet.get("/livez", port=health) == (200, {"live": True})

    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "out", fleet.openai().completions.create(model="test", prompt="inflight")))
    t.start()
    wait_until(lambda: list(fleet.dir.glob("started-*")), "the request to start")
    pod.popen.send_signal(signal.SIGTERM)  # what the kubelet sends to the container's first process

    wait_until(lambda: fleet.get("/ready")[0] == 503, "the master to stop routing to the draining replica")
    assert fleet.get("/readyz", port=health)[0] == 503
    with pytest.raises(openai.InternalServerError, match="stage.s. a"):
        fleet.openai().completions.create(model="test", prompt="new")
    assert pod.alive()  # still finishing the request it holds

    (fleet.dir / "gate").touch()
    t.join(timeout=30)
    assert result["out"].choices[0].text == "inflight@pod-a"
    assert pod.popen.wait(timeout=30) == 0
    # Sent before the pod exited; the master reads it in its own time.
    wait_until(lambda: "deregistered" in fleet.procs["master"].output(), "the master to read the Deregister")


def test_control_call_to_a_replica_that_dies_is_answered_at_once(make_fleet):
    """The call's answer is the loss, not a wait for the call's timeout (the new session is a new identity)."""
    fleet = make_fleet(pipeline(stage("a", "echo", finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    answer: dict = {}

    def call() -> None:
        answer.update(fleet.control("a", {"method": "wait_gate", "timeout": 300})[1])

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: (fleet.dir / "control-waiting-pod-a").exists(), "the control call to reach the stage")
    fleet.procs["pod-a"].signal_group(signal.SIGKILL)
    caller.join(timeout=60)  # the urllib timeout (30 s) ends it too, far short of the call's 300 s
    (rep,) = answer["replicas"].values()
    assert rep == {"ok": False, "error": "replica was lost before answering"}


def test_a_flood_of_outputs_leaves_the_master_responsive(make_fleet):
    """A stage streams tiny chunks as fast as it can; the master still answers HTTP meanwhile.

    A receive that finds a message queued returns without yielding, so a
    receive loop over a backlog held heartbeats and HTTP until it was empty
    (and the stage judged the master lost mid-request).
    """
    chunks = 150_000
    fleet = make_fleet(pipeline(stage("a", "flood", finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    done, result = threading.Event(), {}

    def flood() -> None:
        out = fleet.openai(timeout=80).completions.create(
            model="test", prompt="go", extra_body={"stage_sampling_params": {"a": {"chunks": chunks}}})
        result["text"] = out.choices[0].text
        done.set()

    caller = threading.Thread(target=flood)
    caller.start()
    wait_until(lambda: (fleet.dir / "flooding").exists(), "the stage to start flooding")
    assert fleet.get("/health")[0] == 200
    answered_during_the_flood = not done.is_set()
    caller.join(timeout=80)
    assert result["text"] == "".join(f"{i}," for i in range(chunks))
    assert answered_during_the_flood
    assert "master session ended" not in fleet.procs["pod-a"].output()
    assert fleet.metric("omnifleet_replica_lost_total") == 0


def test_a_pause_of_the_whole_fleet_is_no_death(make_fleet):
    """Every process stops for longer than the heartbeat timeout, then all go on (a paused VM, a throttled node).

    Each side sees that its own loop stalled and does not count the pause as
    the other's silence; a lone stage that stops that long is lost (the next test).
    """
    fleet, client = upper_exclaim_fleet(make_fleet)
    assert client.completions.create(model="test", prompt="before").choices[0].text == "BEFORE!"

    procs = list(fleet.procs.values())
    for proc in procs:
        proc.signal_group(signal.SIGSTOP)
    time.sleep(C.HEARTBEAT_TIMEOUT_S + 1.0)  # the pause itself
    for proc in procs:
        proc.signal_group(signal.SIGCONT)
    # A false loss would be judged within one timeout of the resume.
    time.sleep(C.HEARTBEAT_TIMEOUT_S + 2 * C.HEARTBEAT_INTERVAL_S)

    assert client.completions.create(model="test", prompt="after").choices[0].text == "AFTER!"
    for pod in ("pod-a", "pod-b"):
        assert "master session ended" not in fleet.procs[pod].output()
    assert fleet.metric("omnifleet_replica_lost_total") == 0
    assert "the master's event loop stalled" in fleet.procs["master"].output()  # the pause was seen
    for pod in ("pod-a", "pod-b"):
        assert "stage's event loop stalled" in fleet.procs[pod].output()


def test_a_dead_replica_is_lost_by_its_closed_connection_a_hung_one_by_silence(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "upper", replicas=2), stage("b", "exclaim", inputs=["a"],
                                                                     finalOutput="text")))
    fleet.start_master()
    for pod in ("pod-a1", "pod-a2", "pod-b"):
        fleet.start_pod(pod, pod[4])
    fleet.wait_ready()
    replicas = lambda: fleet.metric("omnifleet_stage_replicas", stage="a")  # noqa: E731

    fleet.procs["pod-a1"].signal_group(signal.SIGKILL)
    wait_until(lambda: replicas() == 1, "the killed replica to be dropped")
    assert "replica a/pod-a1 lost: its connection closed" in fleet.procs["master"].output()

    fleet.procs["pod-a2"].signal_group(signal.SIGSTOP)  # hung: its connection stays open
    wait_until(lambda: replicas() == 0, "the hung replica to be dropped", timeout=30)
    assert f"replica a/pod-a2 lost: no heartbeat for {C.HEARTBEAT_TIMEOUT_S:.1f}s" in fleet.procs["master"].output()
    fleet.procs["pod-a2"].signal_group(signal.SIGCONT)  # it wakes up, is told it is unknown, registers again
    wait_until(lambda: replicas() == 1, "the woken replica to register again", timeout=30)
    assert fleet.openai().completions.create(model="test", prompt="again").choices[0].text == "AGAIN!"
    assert fleet.metric("omnifleet_replica_lost_total", stage="a") == 2


def test_heartbeat_settings_come_from_the_spec_and_the_flags(make_fleet):
    """spec.heartbeat sets both sides; a flag overrides it for one process."""
    doc = pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text"))
    doc["spec"]["heartbeat"] = {"intervalSeconds": 0.2, "timeoutSeconds": 1.0}
    fleet = make_fleet(doc)
    fleet.start_master("--heartbeat-timeout", "1.5")
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()

    fleet.procs["pod-a"].signal_group(signal.SIGSTOP)
    wait_until(lambda: fleet.metric("omnifleet_stage_replicas", stage="a") == 0, "the hung replica to be dropped")
    assert "replica a/pod-a lost: no heartbeat for 1.5s" in fleet.procs["master"].output()
    fleet.procs["pod-a"].signal_group(signal.SIGCONT)

    fleet.procs["master"].signal_group(signal.SIGSTOP)
    wait_until(lambda: "no heartbeat from the master for 1s" in fleet.procs["pod-b"].output(),
               "the stage to give up on the silent master (spec: 1 s)")
    fleet.procs["master"].signal_group(signal.SIGCONT)
    fleet.wait_ready()
    assert fleet.openai().completions.create(model="test", prompt="back").choices[0].text == "BACK!"


@pytest.mark.parametrize("flags,message", [
    (("--heartbeat-interval", "1", "--heartbeat-timeout", "1.5"), "heartbeat timeout 1.5s must be at least twice"),
    (("--heartbeat-timeout", "-1"), "--heartbeat-timeout must be a positive number of seconds, got -1"),
])
def test_bad_heartbeat_flags_are_refused_by_name(make_fleet, flags, message):
    fleet = make_fleet(pipeline(stage("a", "upper", finalOutput="text")))
    master = fleet.start_master(*flags)
    assert master.popen.wait(timeout=30) == 1
    assert message in master.output()


def test_sigterm_to_the_master_drains_its_requests_and_exits_zero(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "gated_entry", finalOutput="text")))
    master = fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "out", fleet.openai().completions.create(model="test", prompt="inflight")))
    t.start()
    wait_until(lambda: list(fleet.dir.glob("started-*")), "the request to start")
    master.popen.send_signal(signal.SIGTERM)  # what the kubelet sends

    status, body = wait_until(lambda: (r := fleet.get("/ready"))[0] == 503 and r, "/ready to turn 503")
    assert body["draining"] is True and body["message"] == "the master is shutting down"
    # Not ready either: kube-proxy would otherwise keep sending it new connections while no other master is ready.
    assert fleet.get("/readyz") == (503, {"ready": False, "draining": True})
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "new"})
    assert status == 503 and "the master is shutting down" in body["error"]["message"]
    assert master.alive()  # still finishing the request it holds

    (fleet.dir / "gate").touch()
    t.join(timeout=30)
    assert result["out"].choices[0].text == "inflight@pod-a"
    assert master.popen.wait(timeout=30) == 0
    assert "every request finished; exiting" in master.output()


LINGER_S = 8  # room for the checks below inside it on a starved machine


def test_an_idle_master_keeps_answering_503_after_sigterm_for_its_linger(make_fleet):
    """Nothing in flight: the master still answers (503) for its linger, so requests that the Service
    routed to it before its endpoint was removed get a clear error instead of a reset connection. The
    linger here comes from the environment (spec.master.env), as a pipeline sets it."""
    fleet = make_fleet(pipeline(stage("a", "upper", finalOutput="text")))
    fleet.env[C.ENV_DRAIN_LINGER] = str(LINGER_S)
    master = fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    master.popen.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_until(lambda: fleet.get("/ready")[0] == 503, "/ready to turn 503")
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "late"})
    assert status == 503 and "the master is shutting down" in body["error"]["message"]
    assert master.alive() and time.monotonic() - signalled < LINGER_S
    assert master.popen.wait(timeout=30) == 0
    assert time.monotonic() - signalled >= LINGER_S


def test_a_draining_master_stays_while_requests_keep_coming_and_closes_their_connections(make_fleet):
    """Requests still arriving after the linger mean a proxy still routes here (an endpoint removal slower
    than the linger): the master answers them (503) until none has come for --drain-quiet, then exits.
    Each of those answers closes its connection, so a keep-alive client's retry is routed anew."""
    fleet = make_fleet(pipeline(stage("a", "upper", finalOutput="text")))
    quiet = 4.0
    master = fleet.start_master("--drain-linger", "1", "--drain-quiet", str(quiet))
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    master.popen.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    wait_until(lambda: fleet.get("/ready")[0] == 503, "/ready to turn 503")
    statuses = []
    while time.monotonic() - signalled < 7:  # well past the 1 s linger; a reset or refusal raises here
        conn = http.client.HTTPConnection("127.0.0.1", fleet.api_port, timeout=30)
        sent = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps({"model": "test", "prompt": "late"}),
                     {"Content-Type": "application/json", "Connection": "keep-alive"})
        resp = conn.getresponse()
        statuses.append((resp.status, resp.getheader("Connection"), resp.getheader("Retry-After")))
        resp.read()
        conn.close()
        time.sleep(0.2)
    assert master.alive(), "the master left while requests were still coming"
    assert statuses and set(statuses) == {(503, "close", str(RETRY_AFTER_S))}, statuses
    assert master.popen.wait(timeout=30) == 0
    assert time.monotonic() - sent >= quiet  # it came after `sent`; the master waited its quiet period after it
    assert "requests kept coming after the linger" in master.output()


def test_a_draining_master_ends_what_outlives_its_deadline_and_exits_zero(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "gated_entry", finalOutput="text")))
    master = fleet.start_master("--drain-timeout", "1")
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()
    result = {}

    def call():
        try:
            result["status"], result["body"] = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "stuck"})
        except OSError as e:  # the connection closed under it: what must not happen
            result["error"] = e

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: list(fleet.dir.glob("started-*")), "the request to start")
    master.popen.send_signal(signal.SIGTERM)
    assert master.popen.wait(timeout=30) == 0
    t.join(timeout=30)
    # Answered with a clear error: a connection closed under it would tell the client nothing.
    assert "error" not in result and result["status"] == 503, result
    assert "drain deadline" in result["body"]["error"]["message"], result
    assert "drain deadline passed; ending 1 request(s)" in master.output()
