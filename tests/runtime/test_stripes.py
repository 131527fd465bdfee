"""Large data messages split over several connections (spec.security.dataStreams) and put back together.

Real master and stage processes over real sockets: four streams, chunks of 24, 12 and 9 MiB (split)
between small ones (not split, free to overtake the parts of a large one). With `curve` the large
chunks go AES-GCM sealed over the bulk port (seal.py), their keys over CurveZMQ; with `plain-auth`
striped over the data connections. The downstream stage must see every chunk exactly, in the order the
upstream produced them; and so with dataStreams left out, where the stages pick their connections from
this machine's cores. The Assembler's and the Opener's bounds are unit-checked in
tests/unit/test_stripes.py and tests/unit/test_seal.py.
"""

from __future__ import annotations

import pytest

from fleet_harness import Scrape, pipeline, stage
from omnifleet_runtime.seal import PART_BYTES, SEAL_MIN_BYTES
from stagefns import STRIPED_SIZES


def striped_fleet(make_fleet, security: dict):
    """src -> dst in two pods; three requests, each answered exactly (every chunk, in order)."""
    doc = pipeline(stage("src", "striped_source"), stage("dst", "striped_check", inputs=["src"], finalOutput="text"))
    doc["spec"]["security"] = security
    fleet = make_fleet(doc)
    fleet.start_master()
    fleet.start_pod("pod-src", "src")
    fleet.start_pod("pod-dst", "dst")
    fleet.wait_ready()
    want = "".join(f"{i}:{n}:True;" for i, n in enumerate(STRIPED_SIZES))
    for _ in range(3):  # the first request opens the streams one by one; later ones find them all up
        assert fleet.openai(timeout=120).completions.create(model="test", prompt="x").choices[0].text == want
    return fleet


@pytest.mark.parametrize("plane", ["curve", "plain-auth"])
def test_large_chunks_cross_several_connections_exactly_and_in_order(make_fleet, plane):
    fleet = striped_fleet(make_fleet, {"dataPlane": plane, "dataStreams": 4})
    dst = Scrape(fleet.metrics_ports["pod-dst"])
    # the later requests' large chunks came split: 3 per request once all four streams were up
    assert dst.value("omnifleet_worker_striped_messages_total", stage="dst") >= 3
    assert dst.value("omnifleet_worker_received_bytes_total", stage="dst", src="src") >= 3 * sum(STRIPED_SIZES)
    sealed = dst.value("omnifleet_worker_sealed_parts_total", stage="dst")
    if plane == "curve":  # every large chunk of every request went sealed, in parts of PART_BYTES
        assert sealed >= 3 * sum(-(-n // PART_BYTES) for n in STRIPED_SIZES if n >= SEAL_MIN_BYTES)
    else:
        assert sealed == 0


@pytest.mark.parametrize("plane", ["curve", "plain-auth"])
def test_streams_left_out_follow_the_stage_cores(make_fleet, plane):
    """Without dataStreams, a stage opens default_streams(...) connections for this machine's cores: over one
    unencrypted connection a large chunk goes whole (never split); over several, split."""
    from omnifleet_runtime.stripes import default_streams

    streams = default_streams(plane == "curve")  # the stage processes run on this machine
    fleet = striped_fleet(make_fleet, {"dataPlane": plane})
    striped = Scrape(fleet.metrics_ports["pod-dst"]).value("omnifleet_worker_striped_messages_total", stage="dst")
    if streams == 1 and plane == "plain-auth":
        assert striped == 0
    else:  # split over the streams, or into pieces over one encrypted connection
        assert striped >= 3
