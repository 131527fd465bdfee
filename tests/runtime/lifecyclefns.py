"""Stages for the engine lifecycle tests: an engine that never finishes loading, one that
owns a helper process ("its engine process") which a test kills while a request is in flight, and
one whose process cannot exit (a library's thread that never ends).

Only imported by stage processes of those tests (importing starts the helper process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from stagefns import TEST_DIR, mark, prompt_text, wait_for

POD = os.environ.get("OMNIFLEET_POD_NAME", "?")
HELPER = [sys.executable, "-c", "import time; time.sleep(300)"]

if os.environ.get("LIFECYCLE_HANG_ON_LOAD"):
    _child = subprocess.Popen(HELPER)
    (TEST_DIR / f"helper-{POD}.pid").write_text(str(_child.pid))
    time.sleep(120)  # the load that never ends (the watchdog ends it)



def hold_exit() -> None:
    threading.Event().wait()  # never set: the interpreter's exit joins this thread for ever


if os.environ.get("LIFECYCLE_THREAD_HOLDS_EXIT"):
    threading.Thread(target=hold_exit, name="holds-exit").start()  # not a daemon

_engine = subprocess.Popen(HELPER)
(TEST_DIR / f"engine-{POD}.pid").write_text(str(_engine.pid))


def omnifleet_dead():
    code = _engine.poll()
    return None if code is None else f"engine process {_engine.pid} exited with {code}"


async def answer(inputs, sampling_params, context):
    mark(f"inflight-{POD}")
    if not await wait_for("release"):
        raise TimeoutError("never released")
    return f"{POD}:{prompt_text(inputs)}"
