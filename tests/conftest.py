from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail what runs longer than `seconds` (SIGALRM) instead of hanging the suite: each
    suite's autouse fixture wraps its tests in this."""

    def expired(signum, frame):
        raise TimeoutError(f"test ran longer than {seconds}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# Every suite's hang guard; suites with tighter limits (runtime, realnode) set their own inside it.
TEST_TIMEOUT_S = 1200


@pytest.fixture(autouse=True)
def per_test_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


def mp4(frames: int, width: int = 16, height: int = 8, fps: float = 4.0) -> bytes:
    """An MP4 (MPEG-4 part 2, OpenCV's own encoder) of frames whose pixels change from frame to frame."""
    import tempfile

    import cv2
    import numpy as np

    y, x, c = np.mgrid[0:height, 0:width, 0:3]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "v.mp4")
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for i in range(frames):
            out.write(((x * 4 + y * 2 + c * 60 + i * 30) % 256).astype(np.uint8))
        out.release()
        return Path(path).read_bytes()


# The GPU suite runs only where asked for (`make test-gpu` on a machine with a GPU): this machine's run
# leaves it out rather than have it fail for want of a GPU.
collect_ignore = [] if os.environ.get("OMNIFLEET_GPU_TESTS") == "1" else ["gpu"]
