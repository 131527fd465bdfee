"""A resync of a settled pipeline runs no pass; any change of what a pass reads runs one.

The operator's work loop (`handlers._work`) runs against an in-memory object store (a stand-in
for the API server: these tests check which passes run and what they write, which needs no
server); the watch caches are plain dicts of the kept objects, as the operator's watch caches hold them.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from omnifleet_operator import handlers, watches
from omnifleet_operator.reconcile import Children, reconcile
from omnifleet_runtime import constants as C

from .test_keys_and_conflicts import BODY, FakeApi

KEY = ("ns", "p")


class CountingApi(FakeApi):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.events = []

    async def get(self, obj):
        self.calls += 1
        return await super().get(obj)

    async def apply(self, obj, create_only=False):
        self.calls += 1
        return await super().apply(obj, create_only)

    async def write_status(self, namespace, name, status):
        self.calls += 1
        await super().write_status(namespace, name, status)

    async def post_event(self, event):
        self.events.append(event)


def watched(api: CountingApi) -> Children:
    """The store as the watch would show it: every object with a resourceVersion."""
    out = Children()
    for i, obj in enumerate(api.store.values()):
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(100 + i)
        out.objects.append(obj)
    return out


@pytest.fixture
def state(monkeypatch):
    st = handlers.State()
    monkeypatch.setattr(handlers, "STATE", st)
    monkeypatch.setattr(handlers, "PROGRESS_WRITE_SECONDS", 0.0)
    return st


def drain(st: handlers.State, children: Children) -> None:
    """Queue the pipeline (as a resync does) and let one worker run until the queue is empty."""
    cache = watches.Cache("apps", "v1", "deployments", lambda body: body, lambda *_: None)
    cache.index = {KEY: {str(i): o for i, o in enumerate(children.objects)}}  # the uids the watch would give
    cache.listed.set()
    st.caches = [cache]

    async def go():
        worker = asyncio.create_task(handlers._work())
        st.queue.add(KEY)
        while len(st.queue) or st.queue._active:
            await asyncio.sleep(0.01)
        worker.cancel()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_settled_pipeline_is_resynced_without_a_pass_and_a_changed_child_gets_one(state):
    api = CountingApi()
    state.api = api
    state.pipelines[KEY] = copy.deepcopy(BODY)
    drain(state, Children())  # the first pass makes every child
    assert api.applied and KEY not in state.steady
    children = watched(api)
    for _ in range(3):  # the watch shows them: passes until one writes nothing
        drain(state, children)
        if KEY in state.steady:
            break
    assert KEY in state.steady, "a pass with nothing to do is steady"

    passes, calls = state.passes, api.calls
    for _ in range(3):  # resyncs: nothing changed
        drain(state, children)
    assert state.passes == passes and api.calls == calls and state.unchanged == 3

    changed = copy.deepcopy(children)
    changed.objects[0]["metadata"]["resourceVersion"] = "999"  # a child changed (an edit, a status)
    drain(state, changed)
    assert state.passes == passes + 1

    edited = copy.deepcopy(BODY)
    edited["metadata"]["generation"] = 2
    state.pipelines[KEY] = edited  # the spec changed
    drain(state, changed)
    assert state.passes == passes + 2


def test_a_pass_that_wrote_failed_or_waits_is_not_steady():
    api = CountingApi()
    first = asyncio.run(reconcile(api, copy.deepcopy(BODY), Children()))
    assert first.applied and not first.steady  # it made children
    pending = asyncio.run(reconcile(api, copy.deepcopy(BODY), watched(api), last_status=first.status))
    settled = asyncio.run(reconcile(api, copy.deepcopy(BODY), watched(api), last_status=pending.status))
    assert settled.steady and not settled.applied and not settled.status_written

    class Failing(CountingApi):
        async def apply(self, obj, create_only=False):
            raise RuntimeError("apiserver unavailable")

    failing = Failing()
    failing.store = copy.deepcopy(api.store)
    lost = watched(api)
    lost.objects = [o for o in lost.objects if o["kind"] != "Service"]  # one child deleted: to be made again
    out = asyncio.run(reconcile(failing, copy.deepcopy(BODY), lost, last_status=settled.status))
    assert not out.steady  # an error is retried by the next resync


def test_a_cache_keeps_a_child_in_place_when_it_changes_and_reports_moves_and_deletions():
    """An event for a child that stays in its pipeline updates it where it is: the pipeline's children keep
    their order, so their steady digest does not change with the order of their events."""
    events = []
    cache = watches.Cache("apps", "v1", "deployments", lambda body: body["metadata"]["resourceVersion"],
                          lambda kind, body, key: events.append((kind, body["metadata"]["name"], key)))

    def obj(name, pipeline, rv="1"):
        labels = {C.LABEL_PIPELINE: pipeline} if pipeline else {}
        return {"metadata": {"name": name, "uid": f"u-{name}", "namespace": "ns", "labels": labels,
                             "resourceVersion": rv}}

    for name in "abc":
        cache.apply("ADDED", obj(name, "p"))
    cache.apply("MODIFIED", obj("a", "p", rv="2"))
    assert cache.get(("ns", "p")) == ["2", "1", "1"]  # a changed, still first
    cache.apply("MODIFIED", obj("b", "q"))  # its label moved it to another pipeline
    assert cache.get(("ns", "p")) == ["2", "1"] and cache.get(("ns", "q")) == ["1"]
    assert events[-2:] == [("DELETED", "b", ("ns", "p")), ("MODIFIED", "b", ("ns", "q"))]
    cache.apply("MODIFIED", obj("c", None))  # its label removed: it left the pipeline, unseen from now on
    assert cache.get(("ns", "p")) == ["2"] and events[-1] == ("DELETED", "c", ("ns", "p"))
    cache.apply("DELETED", obj("b", "q"))
    assert cache.get(("ns", "q")) == [] and ("ns", "q") not in cache.index and events[-1][0] == "DELETED"


class StatusLog(CountingApi):
    def __init__(self):
        super().__init__()
        self.written = []  # (pipeline, phase) per status write, in order

    async def write_status(self, namespace, name, status):
        self.written.append((name, status["phase"]))
        await super().write_status(namespace, name, status)


def pipeline(name: str, stage_type: str = "python") -> dict:
    body = copy.deepcopy(BODY)
    body["metadata"].update(name=name, uid=f"uid-{name}")
    body["spec"]["stages"][0]["type"] = stage_type
    return body


def test_a_coming_up_status_waits_for_the_pipelines_queued_for_their_children(state):
    """In a mass create the apiserver makes children first: a pass that finds new pipelines still queued holds
    a status that says only "coming up" (written once none waits), but not one that says something is wrong."""
    api = StatusLog()
    state.api = api
    cache = watches.Cache("apps", "v1", "deployments", lambda body: body, lambda *_: None)
    cache.listed.set()
    state.caches = [cache]
    for name, stage_type in (("bad", "no-such-type"), ("first", "python"), ("last", "python")):
        state.pipelines[("ns", name)] = pipeline(name, stage_type)

    async def go():
        for name in ("bad", "first", "last"):  # as their ADDED events queue them: new, so urgent
            state.queue.add(("ns", name), urgent=True)
        assert state.queue.urgent_waiting()
        worker = asyncio.create_task(handlers._work())
        while len(state.queue) or state.queue._active or state.held:
            await asyncio.sleep(0.01)
        worker.cancel()
        assert not state.queue.urgent_waiting()

    asyncio.run(asyncio.wait_for(go(), 30))
    # "bad" is Invalid at once though two wait; "first" made its children before "last" but its Progressing
    # waited while "last" was queued; each written once.
    assert api.written == [("bad", "Invalid"), ("last", "Progressing"), ("first", "Progressing")]
    assert [e["reason"] for e in api.events] == ["InvalidSpec"]  # a new pipeline's first steps post none
    assert {k for k, _ in api.applied if k == "Deployment"} and ("Deployment", "first-master") in api.applied
    assert api.applied.index(("Deployment", "first-master")) < api.applied.index(("Deployment", "last-master"))
