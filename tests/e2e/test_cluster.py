"""The control plane the suite runs on: fake nodes that stay Ready."""

from __future__ import annotations

import datetime as dt

from omnifleet_operator.devcluster import commands as dev

from .kube import Kube


def test_fake_nodes_have_gpus_and_renewed_leases(kube: Kube):
    nodes = {n["metadata"]["name"]: n for n in kube.list("Node")}
    for name, gpus in dev.NODES:
        node = nodes[name]
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", (name, ready)
        assert int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) == gpus
        # kwok renews a Lease per node: without it the node lifecycle controller
        # marks every node (and its pods) not-Ready about 40 s after start.
        lease = kube.request(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}")
        assert lease is not None, f"no Lease for node {name}"
        renewed = dt.datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
        age = (dt.datetime.now(dt.timezone.utc) - renewed).total_seconds()
        assert age < lease["spec"]["leaseDurationSeconds"], (name, lease["spec"])
