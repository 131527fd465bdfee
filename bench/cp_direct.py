"""Pieces of the control-plane benchmark (`bench.control_plane`): the generated pipelines, the
bulk creator of OmniPipelines, the direct server-side-apply client (the limit), a lean raw
watch, and the apiserver audit-log tail that counts who wrote what.

The direct client is "the operator minus the operator": the children come from the same
`omnifleet_operator.render.desired(doc, owner_uid=...)`, and go out through the same
`omnifleet_operator.reconcile.Api.apply` (lightkube's AsyncClient, server-side apply, field
manager `omnifleet`, force) with the same number of requests in flight as the operator has
workers, authenticated as the same ServiceAccount. Neither has a client-side rate limit
(lightkube has none), so "the same client rate limit" means the same concurrency.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import re
import ssl
import time
from pathlib import Path
from typing import Any, Callable

PLACEHOLDER_UID = "00000000-0000-4000-8000-00000000bench"
BENCH_FIELD_MANAGER = "omnifleet-bench"  # how the "user" applies pipelines
STAGES = ("a", "b", "c")

# Resources the operator writes (audit objectRef.resource), children first.
CHILD_RESOURCES = ("serviceaccounts", "configmaps", "networkpolicies", "deployments", "services",
                   "poddisruptionbudgets", "horizontalpodautoscalers")


# ---------------------------------------------------------------- the pipelines


def namespaces(n: int, count: int = 4) -> list[str]:
    return [f"cpb-{i}" for i in range(min(count, max(1, n)))]


def pipeline_docs(n: int, ns_count: int = 4) -> list[dict[str, Any]]:
    """n three-stage pipelines (each stage: gpus 1, replicas 1), round robin over a few namespaces."""
    nss = namespaces(n, ns_count)
    out = []
    for i in range(n):
        out.append({
            "apiVersion": "omnifleet.dev/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": f"p{i:04d}", "namespace": nss[i % len(nss)]},
            "spec": {"model": "bench/model", "stages": [
                {"name": "a", "type": "llm", "gpus": 1, "replicas": 1},
                {"name": "b", "type": "llm", "gpus": 1, "replicas": 1, "inputs": ["a"]},
                {"name": "c", "type": "llm", "gpus": 1, "replicas": 1, "inputs": ["b"], "finalOutput": "text"},
            ]},
        })
    return out


def prerender(docs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """What the operator renders for each pipeline, with a placeholder owner uid."""
    from omnifleet_operator.reconcile import parse
    from omnifleet_operator.render import desired

    out = {}
    for d in docs:
        body = {**d, "metadata": {**d["metadata"], "uid": PLACEHOLDER_UID}}
        doc, problems = parse(body)
        if problems:
            raise ValueError(f"generated pipeline is invalid: {problems}")
        out[(d["metadata"]["namespace"], d["metadata"]["name"])] = desired(doc, owner_uid=PLACEHOLDER_UID)
    return out


def with_owner(objs: list[dict[str, Any]], uid: str) -> list[dict[str, Any]]:
    out = copy.deepcopy(objs)
    for o in out:
        for ref in o["metadata"].get("ownerReferences") or []:
            if ref["uid"] == PLACEHOLDER_UID:
                ref["uid"] = uid
    return out


def children_per_pipeline() -> int:
    return len(next(iter(prerender(pipeline_docs(1)).values())))


# ---------------------------------------------------------------- clients


def async_client(kubeconfig: Path, field_manager: str):
    from lightkube import AsyncClient, KubeConfig

    return AsyncClient(KubeConfig.from_file(str(kubeconfig)), field_manager=field_manager)


async def create_pipelines(client, docs: list[dict[str, Any]], concurrency: int,
                           on_created: Callable[[dict[str, Any], str], None] | None = None) -> dict[str, Any]:
    """Server-side apply each pipeline (the user's `kubectl apply --server-side`), `concurrency` in flight."""
    from lightkube.types import PatchType

    from omnifleet_operator.reconcile import OmniPipelineResource

    todo = list(reversed(docs))
    errors: list[str] = []
    t0 = time.time()

    async def worker() -> None:
        while todo:
            d = todo.pop()
            try:
                got = await client.patch(OmniPipelineResource, d["metadata"]["name"], d,
                                         namespace=d["metadata"]["namespace"], patch_type=PatchType.APPLY,
                                         field_manager=BENCH_FIELD_MANAGER, force=True)
                if on_created is not None:
                    on_created(d, got.metadata.uid)
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors.append(f"{d['metadata']['namespace']}/{d['metadata']['name']}: {err}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"create_s": time.time() - t0, "create_errors": len(errors), "create_first_error": errors[:1]}


async def direct_apply(api, queue: "asyncio.Queue[list[dict[str, Any]] | None]", concurrency: int) -> dict[str, Any]:
    """`concurrency` appliers take pipelines' children off `queue` (fed as pipelines get their uid; None ends
    it) and server-side apply them through the operator's own `Api.apply`; at most `concurrency` requests
    in flight."""
    objs: asyncio.Queue = asyncio.Queue()
    done = 0
    errors: list[str] = []
    last_ok = 0.0

    async def feeder() -> None:
        while (batch := await queue.get()) is not None:
            for o in batch:
                objs.put_nowait(o)
        for _ in range(concurrency):
            objs.put_nowait(None)

    async def applier() -> None:
        nonlocal done, last_ok
        while True:
            o = await objs.get()
            if o is None:
                return
            try:
                await api.apply(o)
                done += 1
                last_ok = time.time()
            except Exception as err:  # noqa: BLE001
                errors.append(f"{o['kind']}/{o['metadata']['name']}: {err}")

    await asyncio.gather(feeder(), *(applier() for _ in range(concurrency)))
    return {"applied": done, "apply_errors": len(errors), "apply_first_error": errors[:1], "last_apply_at": last_ok}


# ---------------------------------------------------------------- a lean watch (no model parsing)


class RawWatch:
    """List+watch one resource collection with the admin token; `on_event(type, obj)` per change.

    Raw JSON lines (no client models), bookmarks on, re-watch from the last resourceVersion when
    the server closes the watch, re-list on 410. Cheap enough to run next to the measured parts.
    """

    def __init__(self, cluster, path: str, on_event: Callable[[str, dict], None], params: dict | None = None):
        self.url = cluster.apiserver_url + path
        self.headers = {"Authorization": f"Bearer {cluster.admin_token}"}
        self.ctx = ssl.create_default_context(cafile=str(cluster.ca_file))
        self.on_event = on_event
        self.params = params or {}
        self.events = 0
        self.restarts = 0

    async def run(self) -> None:
        import httpx2 as httpx

        async with httpx.AsyncClient(verify=self.ctx, headers=self.headers,
                                     timeout=httpx.Timeout(30.0, read=None)) as client:
            rv = None
            while True:
                if rv is None:
                    r = await client.get(self.url, params={**self.params, "limit": "500"})
                    r.raise_for_status()
                    body = r.json()
                    for item in body.get("items") or []:
                        self.on_event("ADDED", item)
                    cont = (body.get("metadata") or {}).get("continue")
                    while cont:
                        r = await client.get(self.url, params={**self.params, "limit": "500", "continue": cont})
                        r.raise_for_status()
                        body2 = r.json()
                        for item in body2.get("items") or []:
                            self.on_event("ADDED", item)
                        cont = (body2.get("metadata") or {}).get("continue")
                    rv = body["metadata"]["resourceVersion"]
                params = {**self.params, "watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
                          "timeoutSeconds": "240"}
                try:
                    async with client.stream("GET", self.url, params=params) as resp:
                        if resp.status_code == 410:
                            rv = None
                            continue
                        resp.raise_for_status()
                        async for line in resp.aiter_lines():
                            if not line.strip():
                                continue
                            ev = json.loads(line)
                            obj = ev.get("object") or {}
                            if ev.get("type") == "ERROR":
                                if obj.get("code") == 410:
                                    rv = None
                                break
                            rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                            if ev.get("type") != "BOOKMARK":
                                self.events += 1
                                self.on_event(ev["type"], obj)
                except (httpx.TransportError, httpx.HTTPStatusError):
                    await asyncio.sleep(0.5)
                self.restarts += 1


# ---------------------------------------------------------------- the audit log


def audit_time(ts: str) -> float:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


_USER = re.compile(rb'"username":"([^"]*)"')
_AGENT = re.compile(rb'"userAgent":"([^"/ ]*)')


class AuditTail:
    """Reads the apiserver's audit log (JSON lines, one per write at ResponseComplete) as it grows.

    Keeps every event of `users` parsed; counts everyone's writes by user.
    """

    def __init__(self, path: Path, users: tuple[str, ...]):
        self.path = path
        self.users = users
        self._needles = [u.encode() for u in users]
        self.offset = 0
        self._partial = b""
        self.lines = 0
        self.events: list[dict] = []  # of `users`, in log order
        self.by_user: dict[str, int] = {}

    def poll(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return 0
        if not data:
            return 0
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        new = 0
        for line in lines:
            if not line:
                continue
            self.lines += 1
            m = _USER.search(line)
            user = m.group(1).decode() if m else "?"
            a = _AGENT.search(line)
            who = f"{user} ({a.group(1).decode() if a else '?'})"  # kcm, scheduler, kwok all use admin here
            self.by_user[who] = self.by_user.get(who, 0) + 1
            if user in self.users:
                e = json.loads(line)
                ref = e.get("objectRef") or {}
                # Only what the benchmark reads: a full audit event is ~10x bigger in memory.
                self.events.append({
                    "user": {"username": user}, "verb": e.get("verb"), "stageTimestamp": e.get("stageTimestamp"),
                    "objectRef": {k: ref.get(k) for k in ("resource", "subresource", "namespace", "name")},
                    "responseStatus": {"code": (e.get("responseStatus") or {}).get("code")}})
                new += 1
        return new

    def mark(self) -> dict:
        """Where the tail stands now (to count later events only)."""
        self.poll()
        return {"events": len(self.events), "by_user": dict(self.by_user), "lines": self.lines}

    def since(self, mark: dict, user: str | None = None) -> list[dict]:
        evs = self.events[mark["events"]:]
        return [e for e in evs if user is None or e["user"]["username"] == user]

    def users_since(self, mark: dict) -> dict[str, int]:
        return {u: n - mark["by_user"].get(u, 0) for u, n in self.by_user.items() if n - mark["by_user"].get(u, 0)}


def classify(ev: dict) -> str:
    """A write of the operator (or the direct client), by what it is."""
    ref = ev.get("objectRef") or {}
    res, sub = ref.get("resource", ""), ref.get("subresource")
    code = (ev.get("responseStatus") or {}).get("code", 0)
    if code >= 400:
        return "error"
    if res == "omnipipelines" and sub == "status":
        return "status"
    if res == "events":
        return "event"
    if res in CHILD_RESOURCES:
        if ev.get("verb") == "delete":
            return "child_delete"
        return "child_create" if code == 201 else "child_update"
    return "other"


def summarize(evs: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in evs:
        k = classify(e)
        out[k] = out.get(k, 0) + 1
    return out


def describe(ev: dict) -> str:
    ref = ev.get("objectRef") or {}
    res = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return (f"{ev.get('verb')} {res} {ref.get('namespace')}/{ref.get('name')} -> "
            f"{(ev.get('responseStatus') or {}).get('code')}")
