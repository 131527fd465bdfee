"""Fixtures of the real-pods suite: the dev cluster with its real node, the repo's images, the
operator running in the cluster from its own image, and the tiny vLLM pipeline.

One cluster for the package (down after its last test, so later suites do not share the CPU with it):
`omnifleet dev up` in a tmp state dir (the same code path as `make run`:
Debian packages, Go-built binaries, buildah-built images loaded into the node's
containerd, `kubectl apply -k manifests/`). Whatever cannot be set up fails the
suite: nothing here skips. Every test has an overall timeout.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from omnifleet_operator.devcluster import commands as dev
from omnifleet_operator.devcluster.cluster import DevCluster
from omnifleet_operator.localdemo import prepare

from ..e2e.kube import Kube, wait_for
from ..conftest import time_limit

REPO = Path(__file__).resolve().parents[2]
TEST_TIMEOUT_S = 600
READY_TIMEOUT_S = 420  # two vLLM engines loading at once on 2 cores
PSA_RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
                  "pod-security.kubernetes.io/enforce-version": "latest"}
_COUNTER = iter(range(1, 1000))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.realnode)


@pytest.fixture(autouse=True)
def overall_timeout():
    with time_limit(TEST_TIMEOUT_S):
        yield


@pytest.fixture(scope="package")
def model_dir() -> Path:
    return Path(prepare())


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    state = tmp_path_factory.mktemp("realnode")
    started = time.monotonic()
    try:  # a failure part-way through up() must not leave the node's processes behind either
        c = dev.up(state, real_node=True)
        print(f"dev up (real node, images, operator in the cluster): {time.monotonic() - started:.0f}s", flush=True)
        yield c
    finally:
        dev.down(state)


@pytest.fixture(scope="package")
def kube(cluster: DevCluster) -> Kube:
    return Kube(cluster)


def make_namespace(cluster: DevCluster, slug: str, labels: dict[str, str] | None = None) -> str:
    name = f"rn-{next(_COUNTER)}-{re.sub(r'[^a-z0-9]+', '-', slug.lower()).strip('-')[:40].strip('-')}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}))
    return name


def model_claim(cluster: DevCluster, namespace: str, model_dir: Path, claim: str = "tiny-qwen2") -> None:
    for obj in dev.weights_volume(namespace, claim, path=str(model_dir), size="1Gi"):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def pod_logs(cluster: DevCluster, namespace: str, selector: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, "-l", selector, "--tail=-1", "--all-containers",
                           "--prefix", check=False, timeout=60).stdout


def describe_failure(cluster: DevCluster, namespace: str) -> str:
    out = [cluster.kubectl("get", "omnip,deploy,pods", "-n", namespace, "-o", "wide", check=False).stdout]
    out.append(cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout[-4000:])
    out.append(pod_logs(cluster, namespace, "omnifleet.dev/pipeline")[-6000:])
    return "\n".join(out)


def wait_ready(kube: Kube, cluster: DevCluster, namespace: str, name: str, timeout: float = READY_TIMEOUT_S) -> dict:
    try:
        return kube.wait_ready(namespace, name, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{describe_failure(cluster, namespace)}") from None


__all__ = ["wait_for"]
