"""Which masters a stage registers with: `--master` parsed, and resolved again and again.

`--master` names one or more HOST:PORT (comma-separated). A HOST may be a
DNS name resolving to several addresses (the masters' headless Service):
each address is one master, and the stage keeps one session with each. The
names are resolved again every MASTER_RESOLVE_INTERVAL_S, so a master that
starts later is found and one that is gone is no longer dialled.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

log = logging.getLogger("omnifleet.discovery")

# How often the names are resolved again: a new master gets the stages within a few seconds (a
# headless Service's DNS answer itself may be cached for up to its TTL, 5 s by default in CoreDNS).
MASTER_RESOLVE_INTERVAL_S = 3.0
RESOLVE_TIMEOUT_S = 5.0  # one resolution, bounded: a stuck resolver must not stop the loop


class BadMasterList(ValueError):
    pass


def parse_masters(value: str) -> list[tuple[str, int]]:
    """`host:port[,host:port...]` (IPv6 literals in brackets) -> [(host, port)]; a clear error otherwise."""
    out = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadMasterList(f"{item!r} is not HOST:PORT")
        out.append((host, int(port)))
    if not out:
        raise BadMasterList(f"{value!r} names no master")
    return out


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def resolve(masters: list[tuple[str, int]]) -> set[str] | None:
    """The ZMQ endpoints of every master these names reach now; None when a name could not be resolved
    (then the caller keeps what it has: a resolver hiccup is no reason to drop a live master)."""
    loop = asyncio.get_running_loop()
    out: set[str] = set()
    for host, port in masters:
        try:
            ipaddress.ip_address(host)
            out.add(endpoint(host, port))
            continue
        except ValueError:
            pass
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), RESOLVE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            log.warning("cannot resolve master %s: %s", host, e or "timed out")
            return None
        # One family only: a dual-stack name lists each master twice (an A and an AAAA record), and two
        # sessions with one master would be one too many (it refuses the second). IPv4 where there is any.
        v4 = {info[4][0] for info in infos if info[0] == socket.AF_INET}
        v6 = {info[4][0] for info in infos if info[0] == socket.AF_INET6}
        out |= {endpoint(ip, port) for ip in (v4 or v6)}
    return out
