"""Events about a pipeline are posted by the workers themselves (not through
kopf.event, which needs the context of kopf's own handler tasks)."""

from __future__ import annotations

import asyncio

from lightkube.resources.core_v1 import Event as EventResource

from omnifleet_operator import handlers
from omnifleet_operator.reconcile import Api, Outcome, event_object
from omnifleet_operator.status import Event

BODY = {
    "apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline",
    "metadata": {"name": "speech", "namespace": "team-a", "uid": "u-1", "generation": 2},
    "spec": {},
}


def test_event_object_refers_to_the_pipeline():
    ev = event_object(BODY, Event("Warning", "InvalidSpec", "spec.stages[0].name: bad"), "2025-01-01T00:00:00Z", "host-1")
    assert ev["metadata"] == {"generateName": "speech.", "namespace": "team-a"}
    assert ev["involvedObject"] == {"apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline",
                                    "name": "speech", "namespace": "team-a", "uid": "u-1"}
    assert (ev["type"], ev["reason"], ev["message"]) == ("Warning", "InvalidSpec", "spec.stages[0].name: bad")
    assert ev["source"] == {"component": "omnifleet-operator"} and ev["reportingInstance"] == "host-1"
    assert ev["firstTimestamp"] == ev["lastTimestamp"] == "2025-01-01T00:00:00Z"
    # lightkube accepts it as an Event resource
    assert EventResource.from_dict(ev).involvedObject.uid == "u-1"


def test_long_messages_are_cut():
    ev = event_object(BODY, Event("Normal", "RollingOut", "x" * 5000), "2025-01-01T00:00:00Z")
    assert len(ev["message"]) == 1024 and ev["message"].endswith("...")


class FakeClient:
    def __init__(self):
        self.created = []

    async def create(self, obj, namespace=None):
        self.created.append((obj, namespace))


async def test_worker_posts_events_outside_kopf_handler_context(monkeypatch):
    """The workers run as plain tasks: posting must not need kopf's per-object context."""
    client = FakeClient()
    state = handlers.State()
    state.api = Api(client)  # type: ignore[arg-type]
    key = ("team-a", "speech")
    state.pipelines[key] = BODY

    async def fake_reconcile(api, body, children, registered=None):
        return Outcome(status_written=True, events=[Event("Warning", "CapacityPending", "stage big: 1 pod(s)")])

    monkeypatch.setattr(handlers, "STATE", state)
    monkeypatch.setattr(handlers, "reconcile", fake_reconcile)
    state.queue.add(key)
    worker = asyncio.create_task(handlers._work())
    for _ in range(100):
        if client.created:
            break
        await asyncio.sleep(0.01)
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    assert state.errors == 0
    assert len(client.created) == 1
    obj, namespace = client.created[0]
    assert namespace == "team-a" and obj.reason == "CapacityPending" and obj.type == "Warning"
