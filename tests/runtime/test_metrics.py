"""Prometheus series of real processes: the master's, each stage pod's (its workers merged), under real requests.

Every scrape is parsed with prometheus_client's own parser, so a malformed
exposition fails here as it would in Prometheus.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from fleet_harness import (
    ROOT, Scrape, dashboard_exprs, exported_series, pipeline, series_in, stage, wait_until,
)
from omnifleet_runtime import shm
from stagefns import PAYLOAD_SIZE


def test_master_and_stage_pods_count_real_requests(make_fleet):
    """a (1 MiB blob) -> b (same pod, through /dev/shm) -> c (streams two chunks to the client)."""
    fleet = make_fleet(pipeline(
        stage("a", "blob"),
        stage("b", "blob_info", inputs=["a"], colocateWith="a"),
        stage("c", "halves", inputs=["b"], finalOutput="text"),
    ))
    fleet.start_master()
    fleet.start_pod("pod-ab", "a", "b")
    fleet.start_pod("pod-c", "c")
    fleet.wait_ready()
    master, ab, c = (lambda: Scrape(fleet.api_port)), (lambda: Scrape(fleet.metrics_ports["pod-ab"])), \
        (lambda: Scrape(fleet.metrics_ports["pod-c"]))
    before = ab()
    assert before.value("omnifleet_worker_requests_total") == 0
    assert before.value("omnifleet_pod_worker_up", stage="a") == 1
    assert before.value("omnifleet_pod_worker_up", stage="b") == 1

    n = 3
    client = fleet.openai()
    for _ in range(n):
        out = client.completions.create(model="test", prompt="x").choices[0].text
        assert out == f"pod-ab->pod-ab:{PAYLOAD_SIZE}:memoryview:True"

    # A worker counts a request once it has sent its Done: by then the client may have its answer.
    wait_until(lambda: ab().value("omnifleet_worker_requests_total", outcome="ok") == 2 * n, "a and b to count")
    m, pod_ab, pod_c = master(), ab(), c()
    # The master: its series, and the new per-stage and first-output ones.
    assert m.value("omnifleet_requests_total", api="completion", outcome="ok") == n
    assert m.value("omnifleet_time_to_first_output_seconds_count", stage="c", output="text") == n
    for s in "abc":
        assert m.value("omnifleet_request_stage_seconds_count", stage=s) == n
        assert m.value("omnifleet_stage_replicas", stage=s) == 1
    # A chain's stage shares add up to at most the whole (admission comes before dispatch).
    shares = sum(m.value("omnifleet_request_stage_seconds_sum", stage=s) for s in "abc")
    assert 0 < shares <= m.value("omnifleet_request_latency_seconds_sum")
    wait_until(lambda: master().value("omnifleet_stage_bytes_total", stage="a", path="shm") == n * PAYLOAD_SIZE,
               "the next heartbeat to carry a's shared-memory bytes")

    # The a+b pod: both workers' series in one exposition, each sample labelled with its stage.
    for s in "ab":
        assert pod_ab.value("omnifleet_worker_requests_total", stage=s, outcome="ok") == n
        assert pod_ab.value("omnifleet_worker_request_seconds_count", stage=s) == n
        assert pod_ab.value("omnifleet_worker_inflight", stage=s) == 0
        assert pod_ab.has("process_cpu_seconds_total", stage=s)  # each worker's own process series
    assert pod_ab.value("omnifleet_worker_sent_bytes_total", stage="a", route="b", path="shm") == n * PAYLOAD_SIZE
    assert 0 < pod_ab.value("omnifleet_worker_sent_bytes_total", stage="a", route="b", path="tcp") < PAYLOAD_SIZE
    assert pod_ab.value("omnifleet_worker_sent_bytes_total", stage="b", route="c", path="tcp") > 0
    assert pod_ab.value("omnifleet_worker_received_bytes_total", stage="b", src="a") > 0
    # what the pod holds in /dev/shm is a's pool: one region reused by every request (two, if a request came
    # before the receiver had dropped the last one's view), not a file per transfer
    held = pod_ab.families["omnifleet_pod_shm_bytes"].samples[0].value
    assert held in (shm.size_class(PAYLOAD_SIZE), 2 * shm.size_class(PAYLOAD_SIZE)), held

    # The final stage: two chunks per request, to the master.
    assert pod_c.value("omnifleet_worker_output_chunks_total", stage="c") == 2 * n
    assert pod_c.value("omnifleet_worker_chunk_seconds_count", stage="c") == n  # the gaps between chunks
    assert pod_c.value("omnifleet_worker_first_output_seconds_count", stage="c") == n
    assert pod_c.value("omnifleet_worker_sent_bytes_total", stage="c", route="master", path="tcp") > 0
    assert pod_c.value("omnifleet_worker_received_bytes_total", stage="c", src="b") > 0


def test_in_flight_gauges_follow_a_held_request(make_fleet):
    fleet = make_fleet(pipeline(stage("a", "upper"), stage("b", "first_then_gate", inputs=["a"],
                                                               finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()
    pod_b = lambda: Scrape(fleet.metrics_ports["pod-b"])  # noqa: E731
    result = {}
    caller = threading.Thread(target=lambda: result.update(
        text=fleet.openai().completions.create(model="test", prompt="hold").choices[0].text))
    caller.start()
    wait_until(lambda: pod_b().value("omnifleet_worker_inflight", stage="b") == 1, "b to hold the request")
    assert Scrape(fleet.api_port).value("omnifleet_stage_inflight", stage="b") == 1
    assert pod_b().value("omnifleet_worker_output_chunks_total", stage="b") == 1
    (fleet.dir / "gate").touch()
    caller.join(timeout=30)
    assert result["text"] == "[pod-b]done"
    wait_until(lambda: pod_b().value("omnifleet_worker_inflight", stage="b") == 0, "b to finish")
    assert Scrape(fleet.api_port).value("omnifleet_stage_inflight", stage="b") == 0
    assert pod_b().value("omnifleet_worker_output_chunks_total", stage="b") == 2


def test_an_audio_stage_reports_seconds_of_audio_and_its_real_time_factor(make_fleet):
    fleet = make_fleet(pipeline(stage("text", "upper"), stage("voice", "tone", inputs=["text"],
                                                               finalOutput="audio")))
    fleet.start_master()
    fleet.start_pod("pod-t", "text")
    fleet.start_pod("pod-v", "voice")
    fleet.wait_ready()
    for _ in range(2):
        req = urllib.request.Request(f"{fleet.url}/v1/audio/speech", data=json.dumps({"model": "test", "input": "hi"})
                                     .encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.read(4) == b"RIFF"
    pod_v, m = Scrape(fleet.metrics_ports["pod-v"]), Scrape(fleet.api_port)
    assert pod_v.value("omnifleet_audio_output_seconds_total", stage="voice") == 2.0  # 1 s per request
    assert pod_v.value("omnifleet_audio_realtime_factor_count", stage="voice") == 2
    assert 0 <= pod_v.value("omnifleet_audio_realtime_factor_sum", stage="voice") < 60
    # The autoscaling gauge: work per second of audio over the last minute, the histogram's own mean.
    mean = pod_v.value("omnifleet_audio_realtime_factor_sum", stage="voice") / 2
    assert abs(pod_v.value("omnifleet_worker_realtime_factor", stage="voice") - mean) < 1e-6
    # Every series an HPA may name (schema.AUTOSCALING_METRICS) is exported per stage by the stage pods.
    from omnifleet_runtime.schema import AUTOSCALING_METRICS

    pod_t = Scrape(fleet.metrics_ports["pod-t"])
    for series in AUTOSCALING_METRICS.values():
        assert pod_v.has(series, stage="voice") and pod_t.has(series, stage="text"), series
    assert pod_t.value("omnifleet_worker_realtime_factor", stage="text") == 0  # no audio: nothing to scale on
    assert m.value("omnifleet_time_to_first_output_seconds_count", stage="voice", output="audio") == 2


def test_the_grafana_dashboard_queries_only_series_the_code_exports(make_fleet):
    from prometheus_client import generate_latest

    from omnifleet_operator import handlers  # noqa: F401  (registers the operator's scrape-time gauges)
    from omnifleet_operator import metrics as operator_metrics
    from omnifleet_operator.dashboard import dashboard_json

    checked_in = ROOT / "manifests" / "monitoring" / "grafana-dashboard.json"
    assert checked_in.read_text() == dashboard_json(), \
        "stale: run `omnifleet dashboard -o manifests/monitoring/grafana-dashboard.json`"
    board = json.loads(checked_in.read_text())

    fleet = make_fleet(pipeline(stage("a", "upper"), stage("b", "exclaim", inputs=["a"], finalOutput="text")))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.start_pod("pod-b", "b")
    fleet.wait_ready()
    exported = exported_series(Scrape(fleet.api_port)) | exported_series(Scrape(fleet.metrics_ports["pod-a"]))

    class Text:  # the operator's registry, through the same parser
        def __init__(self, text: str):
            self.families = {f.name: f for f in text_string_to_metric_families(text)}

    exported |= exported_series(Text(generate_latest(operator_metrics.REGISTRY).decode()))

    panels = [p for p in board["panels"] if p["type"] != "row"]
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        names = series_in(expr)
        assert names, f"no series in {expr!r}"
        # vLLM's own series: checked against a real vLLM stage in tests/engines/test_pipeline.py.
        ours = {n for n in names if not n.startswith("vllm:")}
        assert ours <= exported, f"{expr!r} names {sorted(ours - exported)}, which nothing exports"
    # The stages side by side: each of these panels repeats over the stage variable, horizontally.
    repeated = {p["title"].split(":")[0] for p in panels if p.get("repeat") == "stage"}
    assert repeated == {"Load", "Latency", "Errors", "Replicas"}
    assert all(p["repeatDirection"] == "h" for p in panels if p.get("repeat"))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "pipeline", "stage"}
    ids = [t["refId"] for p in panels for t in p["targets"]]
    assert all(ids), "every query has a refId"
