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
    bulk_addr: str = ""
    pid: int = 0
    outstanding: int = 0  # stage tasks the master assigned and has not seen finish
    assigned: int = 0  # ever assigned; breaks ties so equal replicas take turns
    inflight: int = 0  # as the replica reports
    queue_depth: int = 0
    draining: bool = False
    dropped: int = 0  # messages over the bounds, as the replica reports
    bytes: dict[str, int] = field(default_factory=lambda: {"tcp": 0, "shm": 0, "master": 0})
    revision: str = ""  # of its stage ("": a replica that announces none fits any revision)
    # The revisions of the config it runs: (generation, ((stage, revision), ...)).
    announced: tuple[int, tuple[tuple[str, str], ...]] = (0, ())

    def __str__(self) -> str:
        return f"{self.stage}/{self.replica}"


Revisions = dict[str, str]  # stage -> revision


class Membership:
    def __init__(self, stages: list[str], timeout_s: float,
                 own: tuple[int, tuple[tuple[str, str], ...]] = (0, ())):
        self.stages = stages
        self.timeout_s = timeout_s
        self._by_identity: dict[bytes, Replica] = {}
        self._changed = asyncio.Event()
        self.own = own  # the revisions of the master's own config, one candidate among the replicas'
        self._version = 0  # bumped on every change of who is routable
        self._combos: dict[tuple[str, ...], tuple[int, Revisions | None]] = {}
        # The last registration refused, by stage (known stages only: the map stays bounded).
        self.refusals: dict[str, tuple[float, str]] = {}

    def _notify(self) -> None:
        self._version += 1
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

    # -- revisions: a rollout runs old and new replicas side by side; a request uses one revision throughout

    def _candidates(self) -> list[tuple[int, tuple[tuple[str, str], ...]]]:
        """The pipeline revisions known here, newest (highest generation) first."""
        found = {self.own} | {r.announced for r in self._by_identity.values()}
        return sorted(found, key=lambda c: (-c[0], c[1]))

    @staticmethod
    def fits(rep: Replica, revisions: Revisions) -> bool:
        want = revisions.get(rep.stage, "")
        return not want or not rep.revision or rep.revision == want

    def _has(self, stage: str, revisions: Revisions) -> bool:
        """Whether a routable replica of stage fits revisions."""
        return any(self.fits(r, revisions) for r in self.routable(stage))

    def combo(self, stages: list[str] | tuple[str, ...]) -> Revisions | None:
        """The newest pipeline revision with a routable replica of each of `stages` (None: no revision has
        them all). Cached until membership changes: the request path reads it once per request."""
        key = tuple(stages)
        hit = self._combos.get(key)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        found = None
        for _, items in self._candidates():
            revisions = dict(items)
            if all(self._has(s, revisions) for s in stages):
                found = revisions
                break
        if len(self._combos) > 64:  # one entry per set of stages requests use: few
            self._combos.clear()
        self._combos[key] = (self._version, found)
        return found

    def serving(self, rep: Replica) -> bool:
        """Whether new requests may be routed to this replica's revision: it belongs to the revision
        requests go to now, or, when no revision has every stage, to the newest one (so a stage that
        lost its replicas leaves the others ready)."""
        revisions = self.combo(self.stages)
        if revisions is None:
            revisions = dict(self._candidates()[0][1])
        return self.fits(rep, revisions)

    def lacking(self, stages: list[str]) -> str:
        """Why no revision has every stage: what the newest one lacks."""
        generation, items = self._candidates()[0]
        revisions = dict(items)
        lack = [s for s in stages if not self._has(s, revisions)]
        return f"the newest revision (generation {generation}) has no replica of stage(s) {', '.join(lack)}"

    def revisions_present(self, stage: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replicas(stage):
            out[r.revision] = out.get(r.revision, 0) + 1
        return out
