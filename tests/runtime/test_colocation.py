"""Co-located stages: requests stay in their pod, bulk data goes through shared memory."""

from __future__ import annotations

import os

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import shm
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
    # Every shared-memory object was consumed (the receiver unlinks it when it maps it).
    assert not [n for n in os.listdir(shm.shm_dir()) if n.startswith(("omnifleet-colo-1-", "omnifleet-colo-2-"))]
