"""Read the pipeline file every runtime process starts from, and its hash."""

from __future__ import annotations

import hashlib
import json

import yaml

from . import constants as C
from .schema import OmniPipeline
from .validate import dump, load_pipeline, resolve


def load_config(path: str) -> OmniPipeline:
    """The resolved pipeline in the file at path (InvalidPipeline names every problem)."""
    with open(path, encoding="utf-8") as f:
        return resolve(load_pipeline(yaml.safe_load(f)))


# What master and stage must agree on about a stage. Only these: the operator
# rolls a stage's pods when its own settings change and the master's when
# routing changes, so other stages keep running an older file, rightly.
ROUTING_FIELDS = ("name", "type", "inputs", "inputProcessor", "inputMode", "finalOutput", "colocateWith")


def routing_view(doc: OmniPipeline, stage: str) -> dict:
    for s in dump(resolve(doc))["spec"]["stages"]:
        if s["name"] == stage:
            return {k: s[k] for k in ROUTING_FIELDS if k in s}
    raise KeyError(stage)


def config_hash(doc: OmniPipeline, stage: str) -> str:
    """sha256 of one stage's routing view, sent at registration and checked by the master.

    The data plane's security mode is part of it: a stage speaking another
    mode could neither reach nor be reached by the others.
    """
    view = {"stage": routing_view(doc, stage), "dataPlane": doc.spec.security.data_plane}
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# A stage's fields that do not change what its replicas compute: scaling, and pod annotations.
NOT_BEHAVIOUR = ("replicas", "autoscaling", "podAnnotations")


def stage_revisions(doc: OmniPipeline) -> dict[str, str]:
    """Each stage's revision: a hash of everything its replicas compute from (its own settings and the
    pipeline-wide model, image, model volume and security), not of how many run.

    A stage replica announces its own and the whole map at registration; the master routes each request
    through replicas of one map, so a rollout never mixes old and new stages in one request.
    """
    d = dump(resolve(doc))["spec"]
    common = {k: d.get(k) for k in ("model", "image", "modelVolume", "security")}
    out = {}
    for s in d["stages"]:
        view = common | {"stage": {k: v for k, v in s.items() if k not in NOT_BEHAVIOUR}}
        canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
        out[s["name"]] = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    return out


def heartbeat(doc: OmniPipeline, interval_s: float | None = None, timeout_s: float | None = None) -> tuple[float, float]:
    """(interval, timeout) of heartbeats: a command-line flag, else spec.heartbeat, else the default."""
    hb = doc.spec.heartbeat
    interval = interval_s or (hb.interval_seconds if hb else C.HEARTBEAT_INTERVAL_S)
    timeout = timeout_s or (hb.timeout_seconds if hb else C.HEARTBEAT_TIMEOUT_S)
    if timeout < 2 * interval:
        raise ValueError(f"heartbeat timeout {timeout:g}s must be at least twice the interval {interval:g}s")
    return interval, timeout
