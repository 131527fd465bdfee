"""Ports picked by one process and bound later by another (the local runner, the test fleets)."""

from __future__ import annotations

import socket
from pathlib import Path

from omnifleet_operator.ports import spare_port


def test_spare_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [spare_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low for p in ports), [p for p in ports if not 10000 <= p < low]
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

