"""When and how often a reconcile pass reads the master's /ready, and what status makes of it.

`FakeApi` (test_keys_and_conflicts.py) stands in for the API server, and `master_ready` here for
its service proxy to a master: no master pod runs in unit tests. The real master's /ready body is
checked in tests/runtime/test_readiness.py.
"""

from __future__ import annotations

import asyncio

from omnifleet_operator.reconcile import Children, MasterReads, reconcile

from .test_keys_and_conflicts import BODY, FakeApi, stage_pod

REFUSED = {"ready": False, "missing_stages": ["a"], "stages": {"a": {"registered": 0, "routable": 0, "lastRefusal": {
    "reason": "config hash mismatch for stage 'a': the stage has 111, the master has 222", "secondsAgo": 3.2}}}}


class MasterApi(FakeApi):
    def __init__(self, answer):
        super().__init__()
        self.answer, self.reads = answer, []

    async def master_ready(self, namespace, service):
        self.reads.append((namespace, service))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def settle(api, stage_ready):
    """Every Deployment rolled out; the master ready; stage a's one pod ready or not."""
    for (kind, _), o in api.store.items():
        if kind == "Deployment":
            ready = 1 if o["metadata"]["name"] == "p-master" else stage_ready
            o["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": ready}
            o["metadata"]["generation"] = 1


def run(api, reads, pods):
    return asyncio.run(reconcile(api, BODY, Children(objects=list(api.store.values()), pods=pods),
                                 last_status=api.status, master_reads=reads))


def ready(status):
    c = next(c for c in status["conditions"] if c["type"] == "Ready")
    return c["status"], c["reason"], c["message"]


def test_a_refusal_is_read_at_a_bounded_cadence_and_only_while_it_matters():
    api, clock = MasterApi(REFUSED), Clock()
    reads = MasterReads(every_s=15, clock=clock)
    run(api, reads, [])
    settle(api, stage_ready=0)

    run(api, reads, [stage_pod("p-a-1", started=False, ready=False)])  # still loading its engine
    assert api.reads == []
    out = run(api, reads, [stage_pod("p-a-1", started=True, ready=False)])  # loaded, not registered
    assert api.reads == [("ns", "p-master")]
    assert ready(out.status) == ("False", "RegistrationRefused", "the master refuses replicas of stage a: "
                                 "config hash mismatch for stage 'a': the stage has 111, the master has 222")
    assert [e.reason for e in out.events] == ["RegistrationRefused"]
    for _ in range(5):  # passes within the cadence use the last answer
        again = run(api, reads, [stage_pod("p-a-1", started=True, ready=False)])
        assert not again.status_written
    assert len(api.reads) == 1
    clock.now += 15
    run(api, reads, [stage_pod("p-a-1", started=True, ready=False)])
    assert len(api.reads) == 2

    settle(api, stage_ready=1)  # registered: nothing to ask
    out = run(api, reads, [stage_pod("p-a-1", started=True, ready=True)])
    assert len(api.reads) == 2 and ready(out.status)[:2] == ("True", "AllStagesReady")


def test_a_master_that_cannot_be_read_leaves_the_status_to_the_deployments():
    api = MasterApi(OSError("connection refused"))
    reads = MasterReads(every_s=15, clock=Clock())
    run(api, reads, [])
    settle(api, stage_ready=0)
    out = run(api, reads, [stage_pod("p-a-1", started=True, ready=False)])
    assert len(api.reads) == 1
    assert ready(out.status)[:2] == ("False", "WaitingForReady") and "a (0/1 ready)" in ready(out.status)[2]


def test_the_read_goes_to_the_service_proxy_path_and_is_bounded():
    """Api.master_ready against a local HTTP server playing the API server's service proxy (the
    dev cluster's API server will not proxy to loopback endpoints; tests/realnode reads a real master)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lightkube import AsyncClient, KubeConfig

    from omnifleet_operator.reconcile import MASTER_READ_MAX_BYTES, Api

    answers = {"/api/v1/namespaces/ns/services/p-master:http/proxy/ready": (503, b'{"ready": false}')}
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            code, body = answers.get(self.path, (404, b'{"kind": "Status"}'))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def read(namespace="ns", service="p-master"):
        config = KubeConfig.from_dict({
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}], "current-context": "x"})
        client = AsyncClient(config=config)
        try:
            return await Api(client).master_ready(namespace, service)
        finally:
            await client.close()

    try:
        assert asyncio.run(read()) == {"ready": False}
        assert seen == [("/api/v1/namespaces/ns/services/p-master:http/proxy/ready", "Bearer t")]
        assert asyncio.run(read(service="other")) is None  # the proxy's own error: no answer
        path = "/api/v1/namespaces/ns/services/p-master:http/proxy/ready"
        answers[path] = (200, b"[1, 2]")
        assert asyncio.run(read()) is None  # not an object
        answers[path] = (200, b"not json")
        assert asyncio.run(read()) is None
        answers[path] = (200, b'{"x": "' + b"y" * MASTER_READ_MAX_BYTES + b'"}')
        assert asyncio.run(read()) is None  # over the bound
    finally:
        server.shutdown()
