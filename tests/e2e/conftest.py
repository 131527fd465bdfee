"""End-to-end fixtures: a real control plane (DevCluster) and the real operator.

One cluster for the package (torn down after its last test, not at the end of the whole run, where
it would take CPU from every later suite): build the binaries if needed, start a fresh DevCluster in a tmp
dir, add fake nodes (two with 8 GPUs, one CPU-only), install with
`kubectl apply -k manifests/` (the documented install), scale the in-cluster
operator Deployment to 0 and run the operator as a subprocess authenticated as
the omnifleet-operator ServiceAccount, so every test also proves the shipped
ClusterRole is enough. Each test works in its own namespace.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from omnifleet_operator.devcluster import build
from omnifleet_operator.devcluster import commands as dev
from omnifleet_operator.devcluster.cluster import DevCluster

from .kube import OPERATOR_USER, Kube, OperatorRunner, wait_for

_RUNNER: OperatorRunner | None = None
_COUNTER = itertools.count(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    build.ensure_binaries(verbose=True)  # progress on stderr; instant when cached
    c = DevCluster(tmp_path_factory.mktemp("devcluster"), owned=True)  # a killed session leaves nothing
    c.up()
    try:
        dev.add_nodes(c)
        dev.install(c)  # kubectl apply -k manifests/, CRD Established, in-cluster operator scaled to 0
        c.kubectl("apply", "-f", "-", input=json.dumps(GC_CANARY))
        yield c
    finally:
        c.down()


# The garbage collector learns about a new CRD on its discovery resync (every 30 s,
# hard-coded in kube-controller-manager): until then it cannot resolve an
# OmniPipeline owner and leaves the children alone. A ConfigMap owned by a
# pipeline that never existed is deleted once it can: the `gc_ready` signal.
GC_CANARY = {
    "apiVersion": "v1", "kind": "ConfigMap",
    "metadata": {"name": "gc-canary", "namespace": "default", "ownerReferences": [{
        "apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline", "name": "never-existed",
        "uid": "00000000-0000-0000-0000-000000000000"}]},
}


@pytest.fixture(scope="package")
def gc_ready(cluster: DevCluster, kube: Kube) -> None:
    wait_for(lambda: kube.get("ConfigMap", "default", "gc-canary") is None, 90,
             "the garbage collector to know OmniPipelines (its 30 s discovery resync)")


@pytest.fixture(scope="package")
def kube(cluster: DevCluster) -> Kube:
    return Kube(cluster)


@pytest.fixture(scope="package")
def operator(cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory):
    global _RUNNER
    runner = OperatorRunner(cluster, tmp_path_factory.mktemp("operator") / "operator.log")
    runner.start()
    _RUNNER = runner
    try:
        yield runner
    finally:
        runner.stop()
        _RUNNER = None


@pytest.fixture(autouse=True)
def _operator_guard(request: pytest.FixtureRequest):
    """Remember where the operator log stood (printed on failure); afterwards, no 403 for the operator."""
    if "operator" not in request.fixturenames:
        yield
        return
    runner: OperatorRunner = request.getfixturevalue("operator")
    cluster: DevCluster = request.getfixturevalue("cluster")
    if not runner.alive():  # a test that killed it failed before restarting it
        runner.start()
    request.node._operator_log_offset = runner.log_size()
    audit_start = cluster.audit_lines()
    yield
    # The shipped ClusterRole must be enough for everything this test made the operator do. Only RBAC's
    # refusals count: admission refuses creates in a namespace being deleted with a 403 too.
    denied = [w for w in cluster.writes(user=OPERATOR_USER, since_line=audit_start)
              if (w.get("responseStatus") or {}).get("code") == 403
              and (w.get("annotations") or {}).get("authorization.k8s.io/decision") != "allow"]
    log = runner.log_since(request.node._operator_log_offset)
    forbidden = [line for line in log.splitlines() if "forbidden" in line.lower() and "403" in line]
    assert not denied and not forbidden, (
        "the operator was refused by RBAC:\n" + "\n".join(map(str, denied[:5])) + "\n".join(forbidden[:5]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _RUNNER is not None:
        offset = getattr(item, "_operator_log_offset", 0)
        text = _RUNNER.log_since(offset)
        lines = text.splitlines()
        if len(lines) > 300:
            text = "\n".join(["(... cut ...)"] + lines[-300:])
        report.sections.append((f"operator log ({_RUNNER.log})", text or "(empty)"))


@pytest.fixture
def ns(cluster: DevCluster, request: pytest.FixtureRequest):
    """A fresh namespace; afterwards its pipelines are deleted first (so the operator never
    sees a live pipeline lose children to the namespace's deletion), then the namespace."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{next(_COUNTER)}-{slug}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "omnipipelines", "--all", "-n", name, "--wait=false", check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
