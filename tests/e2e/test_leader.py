"""Leader election of the operator's replicas, on the real API server (short leases for the test)."""

from __future__ import annotations

import asyncio

from lightkube import AsyncClient, KubeConfig
from lightkube.resources.coordination_v1 import Lease

from omnifleet_operator.leader import Elector, LostLeadership


LEASE_S = 6  # a few renewals may be slow on a loaded machine without the lease running out


async def test_one_holder_at_a_time_and_takeover_after_expiry(cluster, ns: str):
    client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    a = Elector(client, ns, "replica-a", lease_s=LEASE_S, renew_s=0.5, retry_s=0.2)
    b = Elector(client, ns, "replica-b", lease_s=LEASE_S, renew_s=0.5, retry_s=0.2)
    try:
        await asyncio.wait_for(a.acquire(), 20)
        holding = asyncio.create_task(a.hold())
        waiting = asyncio.create_task(b.acquire())
        await asyncio.sleep(LEASE_S + 1)  # longer than the lease: a renews, so b must still be waiting
        assert not waiting.done() and not holding.done()
        holding.cancel()  # a stops renewing (a dead replica)
        await asyncio.wait_for(waiting, 20)  # b takes over once the lease expired
        lease = await client.get(Lease, "omnifleet-operator", namespace=ns)
        assert lease.spec.holderIdentity == "replica-b" and lease.spec.leaseTransitions == 1
        # a comes back and finds the lease taken: renewing raises instead of writing beside b.
        try:
            await asyncio.wait_for(a.hold(), 10)
            raise AssertionError("a kept leading beside b")
        except LostLeadership:
            pass
    finally:
        await client.close()
