"""Fair turns for loops whose awaits can all complete at once, and stall
detection for loops that wake on a fixed interval.

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
        # A loop starts in a turn of its own (the event loop just ran it): its first yield is due a turn
        # from now, not at its first message (a job would otherwise take a loop iteration after its first
        # chunk, before its end goes out).
        self.next = time.monotonic() + TURN_S

    async def take(self) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + TURN_S
            await asyncio.sleep(0)


class StallWatch:
    """For a loop that wakes at least once per `interval_s`: how long the last
    gap overran it, when by more than one interval (a stall of this process,
    or of the whole machine), else 0. A stall is not a peer's silence."""

    __slots__ = ("interval_s", "last")

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last = time.monotonic()

    def stall(self, now: float) -> float:
        over = now - self.last - self.interval_s
        self.last = now
        return over if over > self.interval_s else 0.0
