"""The operator's caches of its children and their pods: a list and a watch per kind, as client-go's
informers keep them, outside kopf.

kopf runs every watch event through its whole per-object machinery (an object worker and its queue, a
memory, loggers, cause detection, handler invocations) before a handler sees it; for the operator's
children, whose events only update a cache and maybe queue their pipeline, that machinery was most of the
operator's CPU in a mass create. Here an event is a decoded line, a kept object and one callback.

Each cache lists its kind (label-selected, paginated), then watches from the list's resourceVersion with
bookmarks. A stream that ends is resumed from the last resourceVersion seen; one that expired (410) is
listed again, and whatever the new list lacks counts as deleted. Failed requests are retried with backoff,
for as long as the operator runs. A kind the API server does not serve (no CRD yet) is listed again now and
then, quietly after the first warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import msgspec

from omnifleet_runtime import constants as C

from . import metrics

log = logging.getLogger("omnifleet.operator.watch")

Key = tuple[str, str]
# event type ("ADDED", "MODIFIED", "DELETED"; None for an object a list showed), the object, its pipeline
OnEvent = Callable[[str | None, dict[str, Any], Key], None]

LIST_PAGE = 500
BACKOFF_S = (1.0, 2.0, 5.0)
UNSERVED_RETRY_S = 60.0
_decode = msgspec.json.Decoder().decode


class Expired(Exception):
    """The resourceVersion a watch or list continued from is gone (410): list again."""


class Unserved(Exception):
    """The API server does not serve the kind (404 on its list)."""


class Cache:
    """The kept objects of one kind that carry the pipeline label, by (namespace, pipeline)."""

    def __init__(self, group: str, version: str, plural: str, keep: Callable[[dict[str, Any]], Any],
                 on_event: OnEvent, namespaces: list[str] | tuple[str, ...] = (), watch_timeout_s: int = 300):
        self.group, self.version, self.plural = group, version, plural
        self.api_version = f"{group}/{version}" if group else version
        self.name = f"{plural}.{version}.{group}" if group else f"{plural}.{version}"  # as kopf names it
        self.keep, self.on_event = keep, on_event
        self.namespaces = list(namespaces) or [""]
        self.watch_timeout_s = watch_timeout_s
        self.index: dict[Key, dict[str, Any]] = {}  # (namespace, pipeline) -> {uid: kept}
        self._where: dict[str, Key] = {}  # uid -> its key (a pipeline label can be edited)
        self.listed = asyncio.Event()  # every namespace listed once (or the kind is not served)
        self._unlisted = set(self.namespaces)
        # namespace -> the resourceVersion its next watch starts from: its list's, then the last event's
        self._seen_rv: dict[str, str] = {}

    def get(self, key: Key) -> list[Any]:
        objs = self.index.get(key)
        return list(objs.values()) if objs else []

    def apply(self, kind: str | None, body: dict[str, Any]) -> None:
        """One event (kind None: an object a list showed) into the cache, then the callback."""
        meta = body.get("metadata") or {}
        uid, pipeline = meta.get("uid"), (meta.get("labels") or {}).get(C.LABEL_PIPELINE)
        if not uid:
            return
        old, key = self._where.get(uid), (meta.get("namespace") or "", pipeline)
        kept = kind != "DELETED" and pipeline is not None
        if old is not None and (old != key or not kept):
            del self._where[uid]
            self._drop(old, uid)
        if kept:  # in place when it stays: a pipeline's children keep their order (its steady digest too)
            self.index.setdefault(key, {})[uid] = self.keep(body)
            self._where[uid] = key
        if old is not None and old != key:
            self.on_event("DELETED", body, old)  # it left that pipeline
        if pipeline is not None:
            self.on_event(kind, body, key)

    def _drop(self, key: Key, uid: str) -> None:
        objs = self.index.get(key)
        if objs is not None:
            objs.pop(uid, None)
            if not objs:
                del self.index[key]

    def _path(self, namespace: str) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        return f"{base}/namespaces/{quote(namespace)}/{self.plural}" if namespace else f"{base}/{self.plural}"

    async def run(self, http_for: Callable[[str], Any]) -> None:
        """Keep the cache for as long as the operator runs. http_for(namespace): the httpx client of that
        namespace's stream ("": all namespaces), with the API server's URL and credentials."""
        await asyncio.gather(*(self._keep_namespace(http_for(ns), ns) for ns in self.namespaces))

    async def _keep_namespace(self, http: Any, namespace: str) -> None:
        failures, warned = 0, False
        while True:
            try:
                if namespace not in self._seen_rv:
                    self._seen_rv[namespace] = await self._relist(http, namespace)
                    self._mark_listed(namespace)
                await self._watch(http, namespace)  # a failed one resumes after the last event it applied
                failures = 0
            except asyncio.CancelledError:
                raise
            except Expired:
                self._seen_rv.pop(namespace, None)
                metrics.WATCH_RESTARTS.labels(resource=self.name).inc()
            except Unserved:
                if not warned:
                    log.warning("%s is not served by the API server; listing it again every %.0f s",
                                self.name, UNSERVED_RETRY_S)
                    warned = True
                self._mark_listed(namespace)
                await asyncio.sleep(UNSERVED_RETRY_S)
            except Exception as e:  # the API server restarting, a dropped connection, a refusal
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
                metrics.WATCH_RESTARTS.labels(resource=self.name).inc()
                log.warning("watching %s%s failed (%s); again in %.0f s", self.name,
                            f" in {namespace}" if namespace else "", _reason(e), delay)
                await asyncio.sleep(delay)

    def _mark_listed(self, namespace: str) -> None:  # idempotent
        self._unlisted.discard(namespace)
        if not self._unlisted:
            self.listed.set()

    async def _relist(self, http: Any, namespace: str) -> str:
        """List the kind (in pages); the list's resourceVersion. Objects the cache held that the list lacks
        are deleted: their events were missed while the watch was down."""
        params: dict[str, Any] = {"labelSelector": C.LABEL_PIPELINE, "limit": LIST_PAGE}
        seen: set[str] = set()
        while True:
            resp = await http.get(self._path(namespace), params=params)
            _refused(resp.status_code)  # 410: the continue token expired; list again from the start
            resp.raise_for_status()
            page = _decode(resp.content)
            kind = str(page.get("kind") or "").removesuffix("List")
            for item in page.get("items") or ():
                item.setdefault("kind", kind)
                item.setdefault("apiVersion", self.api_version)
                seen.add(item["metadata"].get("uid"))
                self.apply(None, item)
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                break
            params = {**params, "continue": meta["continue"]}
        gone = [uid for uid, key in self._where.items() if uid not in seen and (not namespace or key[0] == namespace)]
        for uid in gone:
            key = self._where.pop(uid)
            kept = self.index.get(key, {}).get(uid)
            self._drop(key, uid)
            self.on_event("DELETED", _stub(kept, uid, key), key)
        return str(meta.get("resourceVersion") or "")

    async def _watch(self, http: Any, namespace: str) -> None:
        """One watch stream from the namespace's resourceVersion until the server ends it, that
        resourceVersion following the events applied."""
        rv = self._seen_rv[namespace]
        params = {"labelSelector": C.LABEL_PIPELINE, "watch": "true", "allowWatchBookmarks": "true",
                  "resourceVersion": rv, "timeoutSeconds": self.watch_timeout_s}
        async with http.stream("GET", self._path(namespace), params=params,
                               timeout=self.watch_timeout_s + 10) as resp:
            _refused(resp.status_code)
            if resp.status_code != 200:
                await resp.aread()
                resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line:
                    continue
                event = _decode(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Expired()
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    obj.setdefault("apiVersion", self.api_version)
                    self.apply(kind, obj)
                rv = self._seen_rv[namespace] = (obj.get("metadata") or {}).get("resourceVersion") or rv


def _refused(status: int) -> None:
    if status == 410:
        raise Expired()
    if status == 404:
        raise Unserved()


def _stub(kept: Any, uid: str, key: Key) -> dict[str, Any]:
    """What a DELETED callback gets for an object whose deletion a relist found: the kept object, with its
    uid and namespace (a kept pod has neither)."""
    body = dict(kept) if isinstance(kept, dict) else {}
    meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    body["metadata"] = {"labels": {C.LABEL_PIPELINE: key[1]}, **meta, "uid": uid, "namespace": key[0]}
    return body


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
