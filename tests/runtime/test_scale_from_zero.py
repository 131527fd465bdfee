"""A stage that scales to zero (autoscaling.minReplicas 0), with real master and stage processes: a request
that finds no replica waits for the first one and is answered; the wait is bounded; the masters' demand for
the stage (what its HPA scales on) counts the waiting request."""

from __future__ import annotations

import threading

import openai
import pytest

from fleet_harness import pipeline, stage, wait_until
from omnifleet_runtime import constants as C


def zero_fleet(make_fleet, activation_s: float):
    fleet = make_fleet(pipeline(
        stage("a", "upper"),
        stage("b", "exclaim", inputs=["a"], finalOutput="text",
              autoscaling={"minReplicas": 0, "maxReplicas": 2, "activationTimeoutSeconds": activation_s}),
    ))
    fleet.start_master()
    fleet.start_pod("pod-a", "a")
    fleet.wait_ready()  # b has no replica: idle, not missing
    status, ready = fleet.get("/ready")
    assert status == 200 and ready["stages"]["b"] == {"registered": 0, "routable": 0, "scaledToZero": True}, ready
    return fleet


def test_a_request_waits_for_the_first_replica_of_a_stage_scaled_to_zero(make_fleet):
    fleet = zero_fleet(make_fleet, 120)
    assert fleet.metric(C.STAGE_DEMAND_METRIC, stage="b") == 0
    answers: list[str] = []
    caller = threading.Thread(target=lambda: answers.append(
        fleet.openai().completions.create(model="test", prompt="wake").choices[0].text))
    caller.start()
    wait_until(lambda: fleet.metric(C.STAGE_DEMAND_METRIC, stage="b") == 1, "the held request in b's demand")
    assert fleet.metric(C.STAGE_DEMAND_METRIC, stage="a") == 1  # held whole: nothing runs until b can
    assert caller.is_alive() and not answers
    fleet.start_pod("pod-b", "b")  # what the HPA does, seeing the demand
    caller.join(timeout=60)
    assert answers == ["WAKE!"]
    wait_until(lambda: fleet.metric(C.STAGE_DEMAND_METRIC, stage="b") == 0, "b's demand back at 0")


def test_the_wait_for_a_first_replica_is_bounded_and_says_why(make_fleet):
    fleet = zero_fleet(make_fleet, 1.5)
    with pytest.raises(openai.APIStatusError) as err:
        fleet.openai().completions.create(model="test", prompt="wake")
    assert err.value.status_code == 503
    message = str(err.value)
    assert "no replica of stage(s) b started within 1.5s (scaled to zero" in message, message
    assert fleet.metric(C.STAGE_DEMAND_METRIC, stage="b") == 0
