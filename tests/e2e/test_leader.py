"""Leader election of the operator's replicas, on the real API server (short leases for the test)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
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


class Relay:
    """A TCP relay on loopback in front of the API server, which a test can cut the way a network fails:
    nothing listening yet (a new pod's network not up: connections refused), or every byte dropped (an API
    server that accepts and never answers)."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.port, self.dropping = target, _free_port(), False
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    async def listen(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            if not self.dropping:
                dst.write(data)
                await dst.drain()
        dst.close()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.server is not None:
            self.server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relayed_client(cluster, relay: Relay, tmp_path: Path) -> AsyncClient:
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"  # 127.0.0.1 is in the serving cert
    path = tmp_path / "relayed.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return AsyncClient(config=KubeConfig.from_file(str(path)))


async def test_unreachable_api_server_is_waited_out_and_a_silent_one_ends_leading_before_the_lease_does(
        cluster, ns: str, tmp_path: Path):
    """A replica whose first requests are refused (its pod's network not up yet) keeps trying and leads once
    the API server answers; it never gives up electing (it did: the operator then looked alive and reconciled
    nothing). A leader whose renewals go unanswered stops leading within its lease, not a request timeout later."""
    url = urlsplit(cluster.apiserver_url)
    relay = Relay((url.hostname, url.port))
    client = _relayed_client(cluster, relay, tmp_path)
    a = Elector(client, ns, "replica-a", lease_s=LEASE_S, renew_s=0.5, retry_s=0.2)
    try:
        acquiring = asyncio.create_task(a.acquire())
        await asyncio.sleep(2)  # about ten refused attempts
        assert not acquiring.done(), acquiring.exception()
        await relay.listen()
        await asyncio.wait_for(acquiring, 20)
        holding = asyncio.create_task(a.hold())
        await asyncio.sleep(2)
        assert not holding.done(), holding.exception()
        relay.dropping = True
        # httpx's own timeout would be later than the lease: hold must give up within the lease.
        with pytest.raises(LostLeadership, match="in time"):
            await asyncio.wait_for(holding, LEASE_S + 1)  # from the drop: within a renewal of the lease
    finally:
        await relay.close()
        await client.close()
