"""Ports picked now and bound later by another process."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_GIVEN: set[int] = set()


def spare_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range, never returned twice by this process.

    A port picked here is bound later by a child process. Below the ephemeral range, no bind to port 0 and
    no outgoing connection (a stage's data port, a client's source port) can take it meanwhile; never twice,
    so two picks before either is bound do not collide.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(500):
        port = random.randrange(10000, low) if low > 11000 else 0
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port on {host} below {low} after 500 tries")
