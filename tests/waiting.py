"""Bounded waits for tests whose own event loop runs what they wait on."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


async def until(pred: Callable[[], Any], what: str, timeout: float = 30.0, step: float = 0.02) -> None:
    """Poll pred, yielding to the loop between polls; AssertionError naming `what` after timeout seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(step)
