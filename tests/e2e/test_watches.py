"""The operator's list-and-watch caches of its children, on the real API server."""

from __future__ import annotations

import asyncio

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap

from omnifleet_operator import watches
from omnifleet_runtime import constants as C
from tests.waiting import until

from .kube import OperatorRunner, idle_period, load_sample, with_namespace


@pytest.fixture
async def client(cluster):
    c = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig)))
    yield c
    await c.close()


def configmap(ns: str, name: str, pipeline: str | None) -> ConfigMap:
    labels = {C.LABEL_PIPELINE: pipeline} if pipeline else {"other": "x"}
    return ConfigMap(metadata=ObjectMeta(name=name, namespace=ns, labels=labels), data={"k": "v"})


class Recorder:
    def __init__(self):
        self.events: list[tuple[str | None, str, tuple[str, str]]] = []

    def __call__(self, kind, body, key):
        self.events.append((kind, body["metadata"]["name"], key))


def names(cache: watches.Cache, key) -> set[str]:
    return {o["metadata"]["name"] for o in cache.get(key)}


async def test_a_cache_lists_then_follows_creates_edits_moves_and_deletes(client, ns: str):
    await client.create(configmap(ns, "before", "p1"))
    await client.create(configmap(ns, "unlabelled", None))
    seen = Recorder()
    cache = watches.Cache("", "v1", "configmaps", lambda body: body, seen, [ns], watch_timeout_s=30)
    task = asyncio.create_task(cache.run(lambda ns: client._client._client))
    try:
        await asyncio.wait_for(cache.listed.wait(), 30)
        assert names(cache, (ns, "p1")) == {"before"} and seen.events == [(None, "before", (ns, "p1"))]
        listed = cache.get((ns, "p1"))[0]
        assert (listed["kind"], listed["apiVersion"]) == ("ConfigMap", "v1")  # a list's items carry neither

        await client.create(configmap(ns, "after", "p1"))
        await until(lambda: names(cache, (ns, "p1")) == {"before", "after"}, "the created ConfigMap")
        await client.patch(ConfigMap, "after", {"metadata": {"labels": {C.LABEL_PIPELINE: "p2"}}}, namespace=ns)
        await until(lambda: names(cache, (ns, "p2")) == {"after"}, "the ConfigMap in its new pipeline")
        assert names(cache, (ns, "p1")) == {"before"}
        assert ("DELETED", "after", (ns, "p1")) in seen.events and ("MODIFIED", "after", (ns, "p2")) in seen.events
        await client.delete(ConfigMap, "before", namespace=ns)
        await until(lambda: (ns, "p1") not in cache.index, "the deletion")
        assert seen.events[-1] == ("DELETED", "before", (ns, "p1"))
        assert all(name != "unlabelled" for _, name, _ in seen.events)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_relist_counts_what_it_lacks_as_deleted(client, ns: str):
    for name in ("a", "b"):
        await client.create(configmap(ns, name, "p"))
    seen = Recorder()
    cache = watches.Cache("", "v1", "configmaps", lambda body: body, seen, [ns])
    http = client._client._client
    await cache._relist(http, ns)
    assert names(cache, (ns, "p")) == {"a", "b"}
    await client.delete(ConfigMap, "a", namespace=ns)  # while no watch runs: its event is missed
    await cache._relist(http, ns)
    assert names(cache, (ns, "p")) == {"b"} and ("DELETED", "a", (ns, "p")) in seen.events


async def test_a_kind_the_server_does_not_serve_counts_as_listed(client):
    cache = watches.Cache("example.invalid", "v1", "widgets", lambda body: body, Recorder())
    task = asyncio.create_task(cache.run(lambda ns: client._client._client))
    try:
        await asyncio.wait_for(cache.listed.wait(), 30)
        assert not task.done()  # it lists again now and then, for a CRD installed later
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_an_operator_of_some_namespaces_keeps_to_them(kube, operator, cluster, ns: str, tmp_path):
    """`--namespace` twice: pipelines in those two are reconciled (each namespace's caches stream over a
    client of their own), one in a third namespace is left alone."""
    doc = load_sample("single.yaml")
    name = doc["metadata"]["name"]
    others = [f"{ns}-b", f"{ns}-c"]
    for other in others:
        cluster.kubectl("create", "namespace", other)
    operator.stop()  # the suite's operator watches every namespace
    scoped = OperatorRunner(cluster, tmp_path / "scoped.log", ("--namespace", ns, "--namespace", others[0]))
    try:
        scoped.start()
        for where in (ns, *others):
            kube.apply(with_namespace(doc, where))
        for where in (ns, others[0]):
            kube.wait_ready(where, name)
        idle_period(2, "the scoped operator had time to touch the third namespace")
        assert kube.children(others[1], name) == [] and not (kube.pipeline(others[1], name) or {}).get("status")
    finally:
        scoped.stop()
        operator.start()
        for other in others:
            cluster.kubectl("delete", "omnipipelines", "--all", "-n", other, "--wait=false", check=False)
            cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
