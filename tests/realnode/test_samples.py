"""Shipped samples whose stages can run here, applied as a user would, on the real node."""

from __future__ import annotations

import json
import urllib.request

from omnifleet_operator.devcluster import commands as dev
from omnifleet_runtime import constants as C

from .conftest import PSA_RESTRICTED, REPO, make_namespace, wait_ready

PYTHON_CODE = REPO / "manifests" / "samples" / "python-code"


def test_python_stages_with_their_code_from_a_configmap(cluster, kube):
    """`kubectl apply -k manifests/samples/python-code/`: the code is a ConfigMap volume on PYTHONPATH."""
    ns = make_namespace(cluster, "python-code", PSA_RESTRICTED)
    cluster.kubectl("apply", "-n", ns, "-k", str(PYTHON_CODE))
    wait_ready(kube, cluster, ns, "python-code", timeout=240)
    forward = dev.PortForward(cluster, ns, "svc/python-code-master", C.MASTER_API_PORT)
    try:
        body = json.dumps({"model": "python-code",
                           "messages": [{"role": "user", "content": "hello brave  new world"}]}).encode()
        req = urllib.request.Request(f"{forward.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        assert answer == "HELLO BRAVE NEW WORLD"
    finally:
        forward.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
