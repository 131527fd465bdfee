"""Fair turns for loops whose awaits can all complete at once.

pyzmq's asyncio sockets hand back an already-finished future when a message
is queued (and a send that fits in the queue finishes at once), and awaiting a
finished future does not give the event loop a turn. A loop working through a
backlog, say a stage streaming thousands of tokens to the master, would then
hold heartbeats, control replies and HTTP until the backlog is gone; long
enough, and its peers declare this process dead.
"""

from __future__ import annotations

import asyncio
import time

TURN_S = 0.005  # the longest one loop runs before the others get a turn


class Turns:
    """`await turns.take()` in each round of a busy loop: yields at most once per TURN_S."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0.0

    async def take(self) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + TURN_S
            await asyncio.sleep(0)
