"""Co-located stages: requests stay in their pod, bulk data goes through shared memory."""

from __future__ import annotations

import json
import os

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import pod, shm
from stagefns import PAYLOAD_SIZE

N = 12


def test_colocated_replica_preferred_and_payload_uses_shm(make_fleet):
    fleet = make_fleet(pipeline(
        stage("talker", "blob", replicas=2),
        stage("vocoder", "blob_info", inputs=["talker"], colocateWith="talker", finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("colo-1", "talker", "vocoder")  # one pod, one process per stage, the first is the host
    fleet.start_pod("colo-2", "talker", "vocoder")
    fleet.wait_ready()

    client = fleet.openai()
    outs = [client.completions.create(model="test", prompt=str(i)).choices[0].text for i in range(N)]
    assert {o.split("->")[0] for o in outs} == {"colo-1", "colo-2"}  # both pods served
    for out in outs:
        upstream, rest = out.split("->")
        # the vocoder ran in the talker's pod and got the intact payload as a zero-copy view
        assert rest == f"{upstream}:{PAYLOAD_SIZE}:memoryview:True"

    # The payload crossed no socket: the talkers sent only message headers over the network.
    wait_until(lambda: fleet.metric("omnifleet_stage_bytes_total", stage="talker", path="shm") == N * PAYLOAD_SIZE,
               "the talkers to report their shared-memory bytes")
    assert 0 < fleet.metric("omnifleet_stage_bytes_total", stage="talker", path="tcp") < N * 1024
    # Every transfer was consumed and its region given back: what is left is each talker's pool, reused
    # (one region per talker serves all its requests), none in transit or held by a reader.
    for name in ("colo-1", "colo-2"):
        wait_until(lambda: all(n.endswith((".free", ".w")) for n in _files(name)), f"{name}'s regions to come back")
        assert 1 <= len(_files(name)) <= 3, _files(name)

    # each stage worker of a pod runs with glibc malloc keeping large freed buffers (its libc reads this at start)
    for name in ("colo-1", "colo-2"):
        workers = _workers(fleet.procs[name].pid)
        assert len(workers) == 2, workers
        for w in workers:  # (glibc, parsing the tunables, may split them in place at its ':'s)
            env = open(f"/proc/{w}/environ", "rb").read().replace(b"\0", b":")
            assert f":GLIBC_TUNABLES={pod.WORKER_MALLOC}:".encode() in b":" + env, env


def _files(name: str) -> list[str]:
    return [n for n in os.listdir(shm.shm_dir()) if n.startswith(shm.pod_prefix(name))]


def _workers(pid: int) -> list[int]:
    """The stage workers a pod process spawned (not multiprocessing's resource tracker)."""
    children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    return [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def test_a_processor_failing_on_chunk_2_of_10_leaves_nothing_in_shared_memory(make_fleet):
    fleet = make_fleet(pipeline(
        stage("src", "shm_chunks"),
        stage("sink", "echo", inputs=["src"], colocateWith="src", inputMode="stream",
              inputProcessor="stagefns:fail_on_second_chunk", finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("shm-pod", "src", "sink")
    fleet.wait_ready()
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": "go"})
    assert status != 200 and "chunk 2 is not to my liking" in json.dumps(body), (status, body)
    wait_until(lambda: fleet.metric("omnifleet_stage_bytes_total", stage="src", path="shm") >= 3 * 256 * 1024,
               "chunks after the failing one to have gone through shared memory")
    # every chunk of the failed request, read or dropped unread, went back to the writer's pool; those that came
    # after the request ended here are dropped as they come, not held as early data for PENDING_TTL_S (60 s)
    wait_until(lambda: _files("shm-pod") and all(n.endswith((".free", ".w")) for n in _files("shm-pod")),
               "every shared-memory region of the failed request to be given back", timeout=30)
