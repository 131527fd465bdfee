"""Shared helpers of the engine tests: the runtime tests' fleet harness, and measurement reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))  # fleet_harness.py
sys.path.insert(0, str(HERE))  # enginefns.py

# vLLM engines on this shared 2-core machine starve whole fleets: CI saw 4.6 s (master,
# talker and vocoder at once), a busy afternoon a 9.5 s stall of the master alone (its
# stages, not stalled themselves, then took it for lost at 10 s). The production
# default is 2 s of silence; these tests allow 20.
HEARTBEAT = {"intervalSeconds": 0.5, "timeoutSeconds": 20}


def report(config: pytest.Config, tag: str, msg: str) -> None:
    """Measurements are shown even without -s (capture is suspended for the print)."""
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\n[{tag}] {msg}", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the shared engine fleet shows the fleet's own log lines (a module fixture's
    teardown output would only show with the module's last test)."""
    outcome = yield
    rep = outcome.get_result()
    fleet = getattr(item, "funcargs", {}).get("fleet")
    if rep.when == "call" and rep.failed and fleet is not None:
        lines = [line for line in fleet.logs().splitlines() if "omnifleet" in line or "Error" in line]
        rep.sections.append(("fleet log lines", "\n".join(lines)[-20000:]))
