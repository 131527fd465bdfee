"""Highly available masters: every stage replica registers with every master; losing one costs only its requests."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from fleet_harness import free_port, pipeline, stage, wait_until
from tests.waiting import until

LOAD_PER_WORKER = 15  # requests each load worker sends (bounded load)
WORKERS_PER_MASTER = 3
HELD_PER_MASTER = 3


def two_stage_pipeline():
    return pipeline(stage("a", "held_upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text"))


def client_of(fleet, api_port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", max_retries=0, timeout=30, api_key="none")


async def test_losing_one_of_two_masters_costs_only_its_requests(make_fleet):
    """Two masters, one pod per stage registered with both, a bounded load through both; one master is SIGKILLed.

    Requests held inside stage a on both masters at the kill tell the two
    sides apart: the killed master's are aborted in the stage at once (before
    the gate opens), the survivor's finish once it opens. Every request on the
    survivor succeeds; every one the killed master held, or was sent after,
    ends with an error; no stage reloads its engine.
    """
    fleet = make_fleet(two_stage_pipeline())
    m2 = (free_port(), free_port(), free_port())
    fleet.master_arg = f"127.0.0.1:{fleet.control_port},127.0.0.1:{m2[1]}"
    fleet.start_master(name="m1")
    fleet.start_master(name="m2", ports=m2)
    pods = {"pod-a": fleet.start_pod("pod-a", "a"), "pod-b": fleet.start_pod("pod-b", "b")}
    pids = {name: proc.pid for name, proc in pods.items()}
    fleet.wait_ready()
    fleet.wait_ready(ports=m2)
    loads = (fleet.dir / "loads.log").read_text()
    clients = {"m1": client_of(fleet, fleet.api_port), "m2": client_of(fleet, m2[0])}
    for name, client in clients.items():  # both masters serve
        out = await client.completions.create(model="test", prompt=f"via {name}")
        assert out.choices[0].text == f"VIA {name.upper()}!"

    outcomes: dict[str, list[str]] = {"m1": [], "m2": []}  # "ok", or the error's type name

    async def one(master: str, prompt: str) -> bool:
        try:
            out = await clients[master].completions.create(model="test", prompt=prompt)
            assert out.choices[0].text == prompt.upper() + "!", out.choices[0].text
            outcomes[master].append("ok")
            return True
        except openai.APIError as e:  # connection refused or reset, or an error answer
            outcomes[master].append(type(e).__name__)
            return False

    async def load(master: str, worker: int) -> None:
        for i in range(LOAD_PER_WORKER):
            if not await one(master, f"{master}-{worker}-{i}"):
                return  # that master is gone: the rest of this worker's requests would go nowhere
            await asyncio.sleep(0.01)

    held = {m: [asyncio.create_task(one(m, f"hold-{m}-{i}")) for i in range(HELD_PER_MASTER)] for m in clients}
    await until(lambda: len(list(fleet.dir.glob("held-*"))) == 2 * HELD_PER_MASTER, "every held request in stage a")
    loaders = [asyncio.create_task(load(m, w)) for m in clients for w in range(WORKERS_PER_MASTER)]
    await until(lambda: len(outcomes["m1"]) >= 5 and len(outcomes["m2"]) >= 5, "the load to run through both")

    fleet.procs["m2"].signal_group(signal.SIGKILL)
    done, _ = await asyncio.wait(held["m2"], timeout=30)  # ended without the gate: by the loss
    assert len(done) == HELD_PER_MASTER
    for i in range(HELD_PER_MASTER):  # and the stage dropped that master's work at once
        await until(lambda: (fleet.dir / f"aborted-hold-m2-{i}").exists(), f"stage a to abort hold-m2-{i}")
    assert not list(fleet.dir.glob("aborted-hold-m1-*"))  # the survivor's work goes on
    (fleet.dir / "gate").touch()
    await asyncio.wait_for(asyncio.gather(*held["m1"], *loaders), 60)

    assert outcomes["m1"] == ["ok"] * (HELD_PER_MASTER + WORKERS_PER_MASTER * LOAD_PER_WORKER)  # 0 failed
    failed_on_m2 = [o for o in outcomes["m2"] if o != "ok"]
    assert len(failed_on_m2) == HELD_PER_MASTER + WORKERS_PER_MASTER  # each held one, and each worker's last
    assert set(failed_on_m2) <= {"APIConnectionError", "APIStatusError", "InternalServerError"}, failed_on_m2

    # No stage reloaded, restarted or left the surviving master; both stay ready.
    assert (fleet.dir / "loads.log").read_text() == loads
    assert {name: proc.pid for name, proc in pods.items() if proc.alive()} == pids
    assert fleet.metric("omnifleet_replica_lost_total") == 0
    for pod in pods:
        assert fleet.get("/readyz", port=fleet.health_ports[pod]) == (200, {"ready": True})
        assert f"master session ended (the master's connection closed); registering again at tcp://127.0.0.1:{m2[1]}" \
            in pods[pod].output()
    out = await clients["m1"].completions.create(model="test", prompt="after")
    assert out.choices[0].text == "AFTER!"

    # The lost master comes back (its pod restarted): the stages register with it again, engines untouched.
    fleet.procs["m2"].popen.wait(timeout=10)
    fleet.start_master(name="m2", ports=m2)
    await asyncio.get_running_loop().run_in_executor(None, lambda: fleet.wait_ready(ports=m2))
    out = await clients["m2"].completions.create(model="test", prompt="back")
    assert out.choices[0].text == "BACK!"
    assert (fleet.dir / "loads.log").read_text() == loads


async def test_a_master_started_later_is_found_and_served(make_fleet):
    """The pods' --master lists a master not started yet; the pods serve the first meanwhile, find the second
    when it starts, and both serve. The first is named by a DNS name (localhost), resolved by the stage."""
    fleet = make_fleet(two_stage_pipeline())
    later = (free_port(), free_port(), free_port())
    fleet.master_arg = f"localhost:{fleet.control_port},127.0.0.1:{later[1]}"
    fleet.start_master(name="m1")
    pods = [fleet.start_pod("pod-a", "a"), fleet.start_pod("pod-b", "b")]
    fleet.wait_ready()
    for pod in ("pod-a", "pod-b"):  # registered with one master of two: ready (it serves)
        wait_until(lambda: fleet.get("/readyz", port=fleet.health_ports[pod])[0] == 200, f"{pod} to be ready")

    fleet.start_master(name="m2", ports=later)
    fleet.wait_ready(ports=later)
    for api_port in (fleet.api_port, later[0]):
        out = await client_of(fleet, api_port).completions.create(model="test", prompt="both")
        assert out.choices[0].text == "BOTH!"
    assert len((fleet.dir / "loads.log").read_text().splitlines()) == 2  # one engine load per stage, still
    for proc in pods:
        # Each master once: localhost is one master, not one per address family.
        assert proc.output().count("registered with master") == 2, proc.output()


@pytest.mark.parametrize("value,message", [
    ("nowhere", "--master: 'nowhere' is not HOST:PORT"),
    ("127.0.0.1:1,", None),  # a trailing comma is no master, and no error
    ("127.0.0.1:99999", "--master: '127.0.0.1:99999' is not HOST:PORT"),
])
def test_a_bad_master_list_is_refused_by_name(make_fleet, value, message):
    fleet = make_fleet(two_stage_pipeline())
    pod = fleet.start_pod("pod-a", "a", extra=("--master", value))  # the last --master wins
    if message is None:
        wait_until(lambda: "engine loaded" in pod.output(), "the stage to start")
        assert pod.alive()
        return
    assert pod.popen.wait(timeout=30) == 1
    assert message in pod.output()
