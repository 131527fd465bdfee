"""The chaos scenario's client (tests/realnode/chaos.py) against a local server that misbehaves on
purpose: each way a request can end is told apart, and every request sent has one outcome."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.realnode import chaos

TEXT, IDS = "hello", [1, 2, 3]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        mode = self.server.mode
        if mode == "lost":
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "hang":
            time.sleep(4.5)
            return
        status, body = {
            "ok": (200, {"choices": [{"message": {"content": TEXT}, "token_ids": IDS}]}),
            "wrong": (200, {"choices": [{"message": {"content": TEXT}, "token_ids": [9]}]}),
            "error": (503, {"error": {"message": "no replica of stage(s) writer", "type": "service_unavailable"}}),
            "unclear": (500, {"detail": "oops"}),
        }[mode]
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(chaos.net, "NODE_IP", "127.0.0.1")
    monkeypatch.setattr(chaos, "CLIENT_TIMEOUT_S", 3.0)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("mode, kind", [("ok", chaos.OK), ("wrong", chaos.WRONG), ("unclear", chaos.UNCLEAR),
                                        ("error", "503 service_unavailable"), ("lost", chaos.LOST),
                                        ("hang", chaos.HUNG)])
def test_each_way_a_request_ends_has_its_own_outcome(server, mode: str, kind: str):
    server.mode = mode
    out = chaos.ask(server.server_address, chaos.chat_body("m", []), TEXT, IDS, time.monotonic())
    assert out.kind == kind, out


def test_a_closed_port_is_refused_at_connect(monkeypatch):
    monkeypatch.setattr(chaos.net, "NODE_IP", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        out = chaos.ask(("127.0.0.1", port), {}, TEXT, IDS, time.monotonic())
    assert out.kind == chaos.REFUSED, out


def test_the_load_stops_at_its_count_and_every_request_sent_has_one_outcome(server, monkeypatch):
    monkeypatch.setattr(chaos, "PAUSE_AFTER_FAILURE_S", 0.0)
    server.mode = "ok"
    load = chaos.Load(lambda t0: chaos.ask(server.server_address, {}, TEXT, IDS, t0), clients=3, seconds=30,
                      max_requests=20).start()
    assert load.wait_first_ok(10)
    load.join()
    assert load.sent == len(load.outcomes) == 20 and load.counts() == {chaos.OK: 20}
    report = chaos.report(load, [], chaos.Recovery(12.5, 3.0, {"master /ready": 12.5}))
    assert report["sent"] == report["succeeded"] == 20 and report["errors"] == {}
    assert report["seconds_from_last_kill_to_recovered"] == 12.5
    assert report["first_check_s"] == 3.0 and report["parts_back_s"] == {"master /ready": 12.5}
