"""Live membership: which stage replicas are registered, alive and routable."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(eq=False)
class Replica:
    stage: str
    replica: str  # the pod name; co-located stages of one pod share it
    identity: bytes  # ZMQ routing id of this registration
    data_addr: str
    last_seen: float
    pid: int = 0
    outstanding: int = 0  # stage tasks the master assigned and has not seen finish
    assigned: int = 0  # ever assigned; breaks ties so equal replicas take turns
    inflight: int = 0  # as the replica reports
    queue_depth: int = 0
    draining: bool = False
    dropped: int = 0  # messages over the bounds, as the replica reports
    bytes: dict[str, int] = field(default_factory=lambda: {"tcp": 0, "shm": 0, "master": 0})

    def __str__(self) -> str:
        return f"{self.stage}/{self.replica}"


class Membership:
    def __init__(self, stages: list[str], timeout_s: float):
        self.stages = stages
        self.timeout_s = timeout_s
        self._by_identity: dict[bytes, Replica] = {}
        self._changed = asyncio.Event()
        # The last registration refused, by stage (known stages only: the map stays bounded).
        self.refusals: dict[str, tuple[float, str]] = {}

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def join(self, rep: Replica) -> Replica | None:
        """Add a new registration; returns the one of the same stage replica it replaces, if any
        (the replica restarted before its old registration timed out)."""
        old = next(
            (r for r in self._by_identity.values() if (r.stage, r.replica) == (rep.stage, rep.replica)), None
        )
        if old is not None:
            del self._by_identity[old.identity]
        self._by_identity[rep.identity] = rep
        self._notify()
        return old

    def refused(self, stage: str, reason: str, now: float) -> None:
        if stage in self.stages:
            self.refusals[stage] = (now, reason)

    def leave(self, identity: bytes) -> Replica | None:
        rep = self._by_identity.pop(identity, None)
        if rep is not None:
            self._notify()
        return rep

    def find(self, stage: str, replica: str) -> Replica | None:
        return next((r for r in self._by_identity.values() if (r.stage, r.replica) == (stage, replica)), None)

    def get(self, identity: bytes) -> Replica | None:
        return self._by_identity.get(identity)

    def set_draining(self, rep: Replica, draining: bool) -> None:
        if rep.draining != draining:
            rep.draining = draining
            self._notify()

    def expire(self, now: float) -> list[Replica]:
        """Remove and return the replicas silent for longer than the timeout."""
        dead = [r for r in self._by_identity.values() if now - r.last_seen > self.timeout_s]
        for r in dead:
            del self._by_identity[r.identity]
        if dead:
            self._notify()
        return dead

    def credit(self, seconds: float) -> None:
        """Do not count the last `seconds` as anyone's silence (this process was not looking)."""
        for r in self._by_identity.values():
            r.last_seen += seconds

    def all(self) -> list[Replica]:
        return list(self._by_identity.values())

    def replicas(self, stage: str) -> list[Replica]:
        return [r for r in self._by_identity.values() if r.stage == stage]

    def routable(self, stage: str) -> list[Replica]:
        return [r for r in self.replicas(stage) if not r.draining]

    def missing(self) -> list[str]:
        """Stages with no replica that takes new work."""
        return [s for s in self.stages if not self.routable(s)]
