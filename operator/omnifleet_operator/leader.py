"""Leader election on a coordination.k8s.io/v1 Lease: with several operator replicas, one writes.

Every replica watches and indexes (reads only); only the holder of the Lease
runs the reconcile workers. The holder renews the Lease every RENEW_S; a
replica takes it over once it has gone LEASE_S without a renewal. A leader
that fails to renew before its Lease would expire exits (Kubernetes restarts
it as a follower), the way controller-runtime's managers do: two writers at
once is the one thing this must never allow. Updates carry the Lease's
resourceVersion, so two candidates racing for it cannot both win. A failed
request (an API error, or a connection refused or timed out, as when a new pod's
network is not up yet) is retried; anything else escapes to the caller.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from lightkube import AsyncClient
from lightkube.core import generic_client
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

log = logging.getLogger("omnifleet.leader")

# What one attempt may fail with and be tried again: lightkube raises its HTTP library's transport errors
# (httpx2 since lightkube 1.0, httpx before), which its client module names httpx.
RETRIED = (ApiError, generic_client.httpx.TransportError)

LEASE_NAME = "omnifleet-operator"
LEASE_S = 15
RENEW_S = 3
RETRY_S = 2


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class LostLeadership(RuntimeError):
    pass


class Elector:
    def __init__(self, client: AsyncClient, namespace: str, identity: str, name: str = LEASE_NAME,
                 lease_s: int = LEASE_S, renew_s: float = RENEW_S, retry_s: float = RETRY_S):
        self.client, self.namespace, self.identity, self.name = client, namespace, identity, name
        self.lease_s, self.renew_s, self.retry_s = lease_s, renew_s, retry_s
        self.transitions = 0

    def _spec(self, acquired: dt.datetime | None, transitions: int) -> LeaseSpec:
        now = _now()
        return LeaseSpec(holderIdentity=self.identity, leaseDurationSeconds=self.lease_s,
                         acquireTime=acquired or now, renewTime=now, leaseTransitions=transitions)

    async def _try(self) -> bool:
        """One attempt to hold the Lease (create, renew, or take over an expired one)."""
        try:
            lease = await self.client.get(Lease, self.name, namespace=self.namespace)
        except ApiError as err:
            if err.status.code != 404:
                raise
            try:
                await self.client.create(Lease(metadata=ObjectMeta(name=self.name, namespace=self.namespace),
                                               spec=self._spec(None, 0)))
                return True
            except ApiError as err2:
                if err2.status.code == 409:  # another replica created it first
                    return False
                raise
        spec = lease.spec or LeaseSpec()
        mine = spec.holderIdentity == self.identity
        renewed = spec.renewTime or spec.acquireTime
        expired = renewed is None or _now() > renewed + dt.timedelta(seconds=spec.leaseDurationSeconds or self.lease_s)
        if not (mine or expired or not spec.holderIdentity):
            return False
        transitions = (spec.leaseTransitions or 0) + (0 if mine else 1)
        lease.spec = self._spec(spec.acquireTime if mine else None, transitions)
        try:
            await self.client.replace(lease)  # carries resourceVersion: a racing update gets 409
        except ApiError as err:
            if err.status.code == 409:
                return False
            raise
        if not mine:
            log.info("took over the lease %s/%s from %r", self.namespace, self.name, spec.holderIdentity)
        return True

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        announced = False
        while True:
            try:
                if await self._try():
                    log.info("leading: holding the lease %s/%s as %s", self.namespace, self.name, self.identity)
                    return
                if not announced:
                    log.info("following: another replica holds the lease %s/%s", self.namespace, self.name)
                    announced = True
            except RETRIED as err:
                log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(err).__name__, err)
            await asyncio.sleep(self.retry_s)

    async def hold(self) -> None:
        """Renew until that fails for longer than the Lease lasts; then raise LostLeadership.

        Writing must stop before another replica may take over, so one attempt gets only the time left
        until then (a request the API server never answers counts as failed)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self.renew_s)
            left = last + self.lease_s - self.renew_s - loop.time()
            try:
                if await asyncio.wait_for(self._try(), max(left, 0.001)):
                    last = loop.time()
                    continue
                raise LostLeadership(f"another replica holds the lease {self.namespace}/{self.name}")
            except RETRIED as err:
                log.warning("renewing the lease %s/%s failed: %s: %s", self.namespace, self.name, type(err).__name__,
                            err)
            except asyncio.TimeoutError:
                log.warning("renewing the lease %s/%s: no answer in %.1f s", self.namespace, self.name, left)
            if loop.time() - last > self.lease_s - self.renew_s:
                raise LostLeadership(f"could not renew the lease {self.namespace}/{self.name} in time")
