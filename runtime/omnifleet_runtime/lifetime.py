"""Processes that die with their parent, however the parent dies.

A runner that is SIGKILLed, OOM-killed or loses its terminal runs no cleanup
code, so its children must not depend on it: the kernel's parent-death signal
(Linux `prctl(PR_SET_PDEATHSIG)`) is sent to the child when the thread that
started it exits, whatever the reason. Standard library only: imported by the
operator's local runner and dev tooling as well as by stage pods.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1
_prctl = None  # looked up once, before any fork: a forked child then takes no loader lock


def _get_prctl():
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl or None


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False where unsupported.

    parent_pid: the parent this process was started by. If it died before the
    request took effect (the child is already orphaned), `sig` is sent now.
    """
    prctl = _get_prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def parent_death_preexec(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when this process dies.

    The signal follows the *thread* that forks, so call Popen from a thread
    that lives as long as the children should (the main thread, typically).
    """
    parent = os.getpid()
    _get_prctl()
    return lambda: die_with_parent(sig, parent)
