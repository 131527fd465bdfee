"""Shared helpers of the engine tests: the runtime tests' fleet harness, and measurement reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "runtime"))  # fleet_harness.py
sys.path.insert(0, str(HERE))  # enginefns.py


def report(config: pytest.Config, tag: str, msg: str) -> None:
    """Measurements are shown even without -s (capture is suspended for the print)."""
    with config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\n[{tag}] {msg}", flush=True)
