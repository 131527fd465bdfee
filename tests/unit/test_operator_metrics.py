"""The operator's /metrics, scraped over HTTP from its real server and parsed by prometheus_client.

No API server runs in the unit tests: the operator's client points at a
loopback port nothing listens on, so every write fails for real (connection
refused) and the pass fails; the series of a successful pass against a real
API server are checked in tests/e2e/test_metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request

import pytest
from lightkube import AsyncClient, KubeConfig
from prometheus_client.parser import text_string_to_metric_families

from omnifleet_operator import handlers, metrics
from omnifleet_operator.reconcile import Api
from omnifleet_operator.ports import spare_port

from ..conftest import REPO


free_port = spare_port


@pytest.fixture(scope="module")
def port():
    server = metrics.serve(free_port(), "127.0.0.1")
    yield server.server_port
    server.shutdown()


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(handlers, "STATE", handlers.State())


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples, series: str, **labels: str) -> float:
    return samples.get((series, frozenset(labels.items())), 0.0)


def pipeline_body() -> dict:
    import yaml

    doc = yaml.safe_load((REPO / "manifests" / "samples" / "single.yaml").read_text())
    doc["metadata"].update(namespace="default", uid="uid-1", generation=1)
    return doc


async def test_a_failed_pass_shows_as_error_with_the_write_that_failed(port):
    closed = free_port()  # nothing listens here: each write is refused by the kernel
    config = KubeConfig.from_dict({
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{closed}"}}],
        "users": [{"name": "u", "user": {"token": "none"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}], "current-context": "x"})
    handlers.STATE.api = Api(AsyncClient(config=config))
    body = pipeline_body()
    key = ("default", body["metadata"]["name"])
    handlers.STATE.pipelines[key] = body
    handlers.STATE.queue.add(key)
    follower = scrape(port)  # a replica that does not hold the Lease reports no queue and no pipelines
    assert value(follower, "leader_election_master_status", name="omnifleet-operator") == 0
    assert value(follower, "workqueue_depth", name="omnipipeline") == 0
    assert value(follower, "omnifleet_operator_pipelines", phase="Unknown") == 0
    handlers.STATE.queue = handlers.WorkQueue()
    handlers.STATE.leading = True  # as _start_workers() sets it
    before = scrape(port)
    handlers.STATE.queue.add(key)
    queued = scrape(port)
    assert value(queued, "leader_election_master_status", name="omnifleet-operator") == 1
    assert value(queued, "workqueue_depth", name="omnipipeline") == 1
    assert value(queued, "workqueue_adds_total", name="omnipipeline") == \
        value(before, "workqueue_adds_total", name="omnipipeline") + 1
    assert value(queued, "omnifleet_operator_pipelines", phase="Unknown") == 1  # no status yet
    assert value(queued, "omnifleet_operator_pipelines", phase="Ready") == 0

    worker = asyncio.create_task(handlers._work())
    try:
        for _ in range(500):
            after = scrape(port)
            if value(after, "controller_runtime_reconcile_total", controller="omnipipeline", result="error") > \
                    value(before, "controller_runtime_reconcile_total", controller="omnipipeline", result="error"):
                break
            await asyncio.sleep(0.02)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await handlers.STATE.api.client.close()
    moved = lambda series, **labels: value(after, series, **labels) - value(before, series, **labels)  # noqa: E731
    assert moved("controller_runtime_reconcile_total", controller="omnipipeline", result="error") == 1
    assert moved("controller_runtime_reconcile_total", controller="omnipipeline", result="success") == 0
    assert moved("controller_runtime_reconcile_errors_total", controller="omnipipeline") == 1
    assert moved("controller_runtime_reconcile_time_seconds_count", controller="omnipipeline") == 1
    # Reading the keys Secret failed (a read: nothing applied), then the status write failed (the pass failed).
    assert moved("omnifleet_operator_write_errors_total", kind="ServiceAccount", verb="apply") == 0
    assert moved("omnifleet_operator_write_errors_total", kind="OmniPipeline", verb="status") == 1
    assert moved("omnifleet_operator_writes_total", kind="ServiceAccount", verb="apply") == 0
    assert value(after, "workqueue_depth", name="omnipipeline") == 0
    assert value(after, "controller_runtime_active_workers", controller="omnipipeline") == 0


def test_watch_restarts_kopf_reports_are_counted(port):
    """kopf logs a restarted watch stream at debug level only; the operator counts those lines."""
    metrics.count_watch_restarts(verbose=False)
    watching = logging.getLogger("kopf._cogs.clients.watching")
    before = scrape(port)
    # The exact lines kopf's watching module writes (kopf/_cogs/clients/watching.py).
    watching.debug("Restarting the watch-stream for deployments.v1.apps cluster-wide.")
    watching.debug("Watch-stream for omnipipelines.v1alpha1.omnifleet.dev in 'ns' is inactive, reconnecting.")
    watching.debug("Starting the watch-stream for pods.v1 cluster-wide.")  # a first start is no restart
    after = scrape(port)
    for resource in ("deployments.v1.apps", "omnipipelines.v1alpha1.omnifleet.dev"):
        assert value(after, "omnifleet_operator_watch_restarts_total", resource=resource) == \
            value(before, "omnifleet_operator_watch_restarts_total", resource=resource) + 1
    assert value(after, "omnifleet_operator_watch_restarts_total", resource="pods.v1") == 0
