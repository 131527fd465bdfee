"""Does a live object already hold everything we would apply?

Server-side apply of an unchanged object writes nothing to etcd, but it is
still a write request. To send nothing at all when nothing changed, the
reconciler compares the rendered object with the live one and applies only
when some field we set is missing or different (a hand edit, say). Fields set
by others (defaults, annotations of other tools, sidecars) are ignored.
"""

from __future__ import annotations

from typing import Any

from . import quantity

# List items are matched by these keys, in order, as Kubernetes' list-map keys do.
_LIST_KEYS = ("name", "containerPort", "port", "type", "key", "uid")


def _key_of(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for k in _LIST_KEYS:
        if all(k in i for i in items):
            return k
    return None


def _zero(value: Any) -> bool:
    # The API server leaves out `omitempty` fields holding their zero value.
    return value is False or value == 0 or value in ("", [], {})


def is_subset(desired: Any, live: Any) -> bool:
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(is_subset(v, live[k]) if k in live else _zero(v) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        key = _key_of(desired)
        if key is None:
            return len(desired) == len(live) and all(is_subset(d, l) for d, l in zip(desired, live))
        by_key = {i.get(key): i for i in live if isinstance(i, dict)}
        return all(d[key] in by_key and is_subset(d, by_key[d[key]]) for d in desired)
    return quantity.equal(desired, live)
