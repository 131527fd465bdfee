"""Fixtures of the runtime tests: a fleet factory, and an overall timeout per test."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fleet_harness.py and stagefns.py

from fleet_harness import Fleet  # noqa: E402
from ..conftest import time_limit  # noqa: E402

TEST_TIMEOUT_S = 90


@pytest.fixture(autouse=True)
def overall_timeout():
    """Fail a test that runs longer than TEST_TIMEOUT_S instead of hanging the suite."""
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def make_fleet(tmp_path, request):
    """make_fleet(pipeline_dict) -> Fleet; everything it started is killed at teardown."""
    fleets: list[Fleet] = []

    def make(doc: dict[str, Any]) -> Fleet:
        fleet = Fleet(tmp_path, doc)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
        fleet.stop()
        if failed:
            print(fleet.logs())
