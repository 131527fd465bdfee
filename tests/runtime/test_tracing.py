"""OpenTelemetry traces across real processes, collected by an OTLP/HTTP receiver in the test process.

The receiver decodes what the processes' own OTLP exporters send (protobuf
ExportTraceServiceRequest); the tests assert the span tree of real requests.
"""

from __future__ import annotations

import gzip
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

from fleet_harness import pipeline, stage, wait_until


class Receiver:
    """OTLP/HTTP traces on 127.0.0.1: every span received, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req: ExportTraceServiceRequest) -> None:
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = v.string_value if v.HasField("string_value") else v.int_value
                    with self.lock:
                        self.spans.append({
                            "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "service": service, "attrs": attrs,
                            "error": s.status.code == 2, "message": s.status.message})

    def named(self, name: str, **attrs) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["name"] == name and all(s["attrs"].get(k) == v for k, v in attrs.items())]


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


def traced(make_fleet, receiver, doc):
    fleet = make_fleet(doc)
    fleet.env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    return fleet


def test_a_three_stage_request_is_one_trace(make_fleet, receiver):
    fleet = traced(make_fleet, receiver, pipeline(
        stage("a", "upper"), stage("b", "exclaim", inputs=["a"]), stage("c", "halves", inputs=["b"],
                                                                          finalOutput="text")))
    fleet.start_master()
    for s in "abc":
        fleet.start_pod(f"pod-{s}", s)
    fleet.wait_ready()
    assert fleet.openai().completions.create(model="test", prompt="hi").choices[0].text == "HI!"
    expected = ["request"] + [f"{kind} {s}" for kind in ("stage", "process") for s in "abc"] + \
        ["transfer a->b", "transfer b->c", "transfer c->master"]
    wait_until(lambda: all(len(receiver.named(name)) == 1 for name in expected),
               "every process to export its spans")  # each exports on its own schedule

    root, = receiver.named("request")
    assert root["parent"] == "" and root["service"] == "omnifleet-master" and not root["error"]
    assert root["attrs"]["omnifleet.api"] == "completion"
    for s in "abc":
        attempt, = receiver.named(f"stage {s}")
        assert (attempt["parent"], attempt["trace"], attempt["service"]) == (root["id"], root["trace"], "omnifleet-master")
        assert attempt["attrs"] == {"omnifleet.stage": s, "omnifleet.replica": f"pod-{s}", "omnifleet.attempt": 0}
        work, = receiver.named(f"process {s}")
        assert (work["parent"], work["trace"], work["service"]) == (attempt["id"], root["trace"], "omnifleet-stage")
        assert not work["error"]
    for src, dst in (("a", "b"), ("b", "c"), ("c", "master")):
        t, = receiver.named(f"transfer {src}->{dst}")
        assert t["parent"] == receiver.named(f"process {src}")[0]["id"] and t["trace"] == root["trace"]
        assert t["attrs"]["omnifleet.transport"] == "tcp" and t["attrs"]["omnifleet.bytes"] > 0
        assert t["attrs"]["omnifleet.chunks"] == (2 if src == "c" else 1)


def test_a_redispatch_after_a_replica_loss_is_a_second_attempt_in_the_same_trace(make_fleet, receiver):
    fleet = traced(make_fleet, receiver, pipeline(
        stage("a", "gated_entry", replicas=2), stage("b", "exclaim", inputs=["a"]),
        stage("c", "echo", inputs=["b"], finalOutput="text")))
    fleet.start_master()
    for pod, s in (("pod-a1", "a"), ("pod-a2", "a"), ("pod-b", "b"), ("pod-c", "c")):
        fleet.start_pod(pod, s)
    fleet.wait_ready()
    result = {}
    caller = threading.Thread(target=lambda: result.update(
        text=fleet.openai().completions.create(model="test", prompt="p").choices[0].text))
    caller.start()
    started = wait_until(lambda: list(fleet.dir.glob("started-*")), "the request to start in stage a")
    victim = started[0].name.rsplit("-", 1)[1]
    survivor = {"a1": "pod-a2", "a2": "pod-a1"}[victim]
    fleet.procs[f"pod-{victim}"].signal_group(signal.SIGKILL)
    (fleet.dir / "gate").touch()
    caller.join(timeout=30)
    assert result["text"] == f"p@{survivor}!"
    # Each process exports on its own schedule; the victim's own spans died with it.
    expected = [("request", None)] + [(f"stage {s}", n) for s in "abc" for n in (0, 1)] + \
        [(f"process {s}", n) for s in "bc" for n in (0, 1)] + [("process a", 1)]
    wait_until(lambda: all(len(receiver.named(name, **({} if n is None else {"omnifleet.attempt": n}))) == 1
                           for name, n in expected), "the spans of both attempts")

    root, = receiver.named("request")
    assert not root["error"]
    lost, = receiver.named("stage a", **{"omnifleet.attempt": 0})
    assert lost["error"] and f"replica pod-{victim} of stage 'a' was lost" in lost["message"]
    assert lost["attrs"]["omnifleet.replica"] == f"pod-{victim}"
    for s in "bc":  # the attempt's other stages were aborted with it
        first, = receiver.named(f"stage {s}", **{"omnifleet.attempt": 0})
        assert first["error"] and first["parent"] == root["id"]
        aborted, = receiver.named(f"process {s}", **{"omnifleet.attempt": 0})
        assert aborted["error"] and aborted["parent"] == first["id"]
    for s in "abc":
        second, = receiver.named(f"stage {s}", **{"omnifleet.attempt": 1})
        assert not second["error"] and second["parent"] == root["id"] and second["trace"] == root["trace"]
        work, = receiver.named(f"process {s}", **{"omnifleet.attempt": 1})
        assert not work["error"] and work["parent"] == second["id"]
    assert receiver.named("stage a", **{"omnifleet.attempt": 1})[0]["attrs"]["omnifleet.replica"] == survivor
