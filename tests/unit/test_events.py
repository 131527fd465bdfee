"""The Event objects the workers post about a pipeline (through the operator's
own client: kopf.event needs the context of kopf's handler tasks). That they
reach a real API server is checked by tests/e2e/test_invalid.py."""

from __future__ import annotations

from lightkube.resources.core_v1 import Event as EventResource

from omnifleet_operator.reconcile import event_object
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
