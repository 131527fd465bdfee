"""A producer torch stage handing tensors to a consumer torch stage, co-located or in two pods: what
tests/runtime (CPU) and tests/gpu (CUDA) both run."""

from __future__ import annotations

import json
from typing import Any

from fleet_harness import Scrape, pipeline

SENT = "omnifleet_worker_sent_bytes_total"


def handoff_fleet(make_fleet, device: str, colocated: bool):
    fill = {"name": "fill", "type": "torch", "entrypoint": "bench.torch_stages:make_fill", "engineArgs": {"device": device}}
    check = {"name": "check", "type": "torch", "entrypoint": "bench.torch_stages:make_check", "engineArgs": {"device": device},
             "inputs": ["fill"], "finalOutput": "text", **({"colocateWith": "fill"} if colocated else {})}
    fleet = make_fleet(pipeline(fill, check))
    fleet.start_master()
    if colocated:
        fleet.start_pod("colo", "fill", "check")
    else:
        fleet.start_pod("prod", "fill")
        fleet.start_pod("cons", "check")
    fleet.wait_ready(timeout=120)  # torch imports in each stage process
    return fleet


def ask(fleet, n: int, v: float) -> dict[str, Any]:
    status, body = fleet.http("POST", "/v1/completions", {"model": "test", "prompt": json.dumps({"n": n, "v": v})})
    assert status == 200, body
    return json.loads(body["choices"][0]["text"])


def sent_bytes(fleet, path: str) -> float:
    """Bytes the producer stage sent to the consumer by this path (tcp, shm, cuda_ipc), from its pod's /metrics."""
    pod = next(p for p, stages in fleet.pod_stages.items() if "fill" in stages)
    return Scrape(fleet.metrics_ports[pod]).value(SENT, stage="fill", route="check", path=path)
