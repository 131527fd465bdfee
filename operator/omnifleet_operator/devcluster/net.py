"""The dev cluster's network: one bridge on this machine, addresses in 198.18.0.0/15 only.

198.18.0.0/15 is reserved for network tests (RFC 2544), so nothing here can
collide with, or route to, a real network:

    198.18.0.1       the bridge: node IP, apiserver, cluster DNS
    198.18.0.0/24    pods of the real node (CNI bridge + host-local)
    198.18.128.0/17  pod IPs that kwok hands to fake pods (bookkeeping, never routed)
    198.19.0.0/16    Services (kube-proxy's iptables rules)

Nothing leaves the bridge: no masquerade, pods get a route to 198.18.0.0/15
only (no default route), and two mangle FORWARD rules drop whatever would be
forwarded between the bridge and any other interface. Stdlib only.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

BRIDGE = "omnifleet0"
NODE_IP = "198.18.0.1"
TEST_NET = "198.18.0.0/15"
POD_CIDR = "198.18.0.0/24"
POD_RANGE_START = "198.18.0.10"
FAKE_POD_CIDR = "198.18.128.0/17"
SERVICE_CIDR = "198.19.0.0/16"
KUBERNETES_SERVICE_IP = "198.19.0.1"  # the first address of SERVICE_CIDR
SYSCTLS = ("net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables")
ISOLATION = (("-i", BRIDGE, "!", "-o", BRIDGE), ("-o", BRIDGE, "!", "-i", BRIDGE))


class NetError(RuntimeError):
    pass


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode:
        raise NetError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _sysctl(key: str) -> str:
    return Path("/proc/sys", *key.split(".")).read_text().strip()


def up(state_dir: Path) -> None:
    """Create the bridge, turn on forwarding (old values kept for down()), isolate it. Idempotent."""
    saved = state_dir / "sysctl.json"
    if not saved.exists():
        if not Path("/proc/sys/net/bridge").exists():
            raise NetError("the kernel has no bridge netfilter (net.bridge.bridge-nf-call-iptables); "
                           "kube-proxy and NetworkPolicy need it")
        saved.write_text(json.dumps({k: _sysctl(k) for k in SYSCTLS}))
    if _run("ip", "link", "show", BRIDGE, check=False).returncode:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "replace", f"{NODE_IP}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    for key in SYSCTLS:
        _run("sysctl", "-qw", f"{key}=1")
    # mangle runs before kube-proxy's and the policy enforcer's filter rules, and neither touches it.
    for rule in ISOLATION:
        if _run("iptables", "-t", "mangle", "-C", "FORWARD", *rule, "-j", "DROP", check=False).returncode:
            _run("iptables", "-t", "mangle", "-I", "FORWARD", *rule, "-j", "DROP")


def down(state_dir: Path) -> None:
    """Undo up(): isolation rules, the bridge, and the sysctls as they were."""
    for rule in ISOLATION:
        while not _run("iptables", "-t", "mangle", "-D", "FORWARD", *rule, "-j", "DROP", check=False).returncode:
            pass
    _run("ip", "link", "del", BRIDGE, check=False)
    saved = state_dir / "sysctl.json"
    if saved.exists():
        for key, value in json.loads(saved.read_text()).items():
            _run("sysctl", "-qw", f"{key}={value}", check=False)
        saved.unlink()


def cni_config(ipam_dir: Path) -> dict:
    """The CNI conflist: bridge + host-local IPAM + portmap; a route to the test net only."""
    return {
        "cniVersion": "1.0.0",
        "name": "omnifleet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP, "rangeStart": POD_RANGE_START}]],
                    "routes": [{"dst": TEST_NET}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def remove_kube_chains() -> None:
    """Delete the KUBE-* and CNI-* chains (and jumps to them) kube-proxy, kubelet and CNI left behind."""
    for table in ("filter", "nat", "mangle", "raw"):
        rules = _run("iptables", "-t", table, "-S", check=False).stdout.splitlines()
        for rule in rules:
            parts = rule.split()
            if rule.startswith("-A ") and "-j" in parts and parts[parts.index("-j") + 1].startswith(("KUBE-", "CNI-")) \
                    and parts[1] in ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"):
                _run("iptables", "-t", table, "-D", *parts[1:], check=False)
        chains = [r.split()[1] for r in rules if r.startswith("-N ") and r.split()[1].startswith(("KUBE-", "CNI-"))]
        for chain in chains:
            _run("iptables", "-t", table, "-F", chain, check=False)
        for chain in chains:
            _run("iptables", "-t", table, "-X", chain, check=False)
