"""The GPU suite: runtime fleets whose torch stages run on CUDA. Run on a machine with a GPU
(`make test-gpu`); the default test run leaves this folder out (tests/conftest.py), and here a machine
without one fails, never skips."""

from __future__ import annotations

import pytest

from ..runtime.conftest import make_fleet, overall_timeout, pytest_runtest_makereport  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError("tests/gpu needs a CUDA GPU: torch.cuda.is_available() is False here")
