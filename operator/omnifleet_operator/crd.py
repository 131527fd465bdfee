"""Generate the CustomResourceDefinition from the pydantic models.

The OpenAPI schema must be structural: every `$ref` inlined, no `anyOf` with
types except int-or-string, no `null` types, no `title`, no `default` (stated
in the description instead, so CEL `has()` sees what the user wrote).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from omnifleet_runtime import constants as C
from omnifleet_runtime.schema import PipelineSpec

Schema = dict[str, Any]


def _inline(node: Any, defs: dict[str, Schema]) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **_inline(rest, defs)})
    return _structural({k: _inline(v, defs) for k, v in node.items()})


def _structural(node: Schema) -> Schema:
    node = dict(node)
    node.pop("title", None)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        # `X | None` -> X: absence means None; Kubernetes has no null type here.
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unsupported union in schema: {options}")
        merged = {**options[0], **node}
        node = merged
    if "default" in node:
        default = node.pop("default")
        if default not in (None, [], {}):
            text = json.dumps(default, separators=(", ", ": "))
            desc = node.get("description", "")
            if "Default:" not in desc:
                node["description"] = f"{desc} Default: {text}.".strip()
    # JSON Schema 2020's numeric exclusive bounds are booleans beside minimum/maximum in OpenAPI v3.
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if node.get("type") == "object" and node.get("additionalProperties") is False:
        node.pop("additionalProperties")  # structural schemas prune unknown fields anyway
    return node


def spec_schema() -> Schema:
    raw = PipelineSpec.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _inline(raw, defs)


CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "description": "Ready, Progressing, Degraded, Reconciling or Stalled."},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "observedGeneration": {"type": "integer", "format": "int64"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
    },
}

STAGE_STATUS = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "host": {"type": "string", "description": "The stage whose pods this one runs in, if co-located."},
        "replicas": {"type": "integer", "description": "Pods of the stage's Deployment."},
        "readyReplicas": {"type": "integer", "description": "Pods that pass their readiness probe."},
        "updatedReplicas": {"type": "integer", "description": "Pods of the current template."},
        "desiredReplicas": {"type": "integer", "description": "Replicas wanted (by the spec or the autoscaler)."},
        "registeredReplicas": {"type": "integer", "description":
                               "Replicas registered with the master (a stage pod is ready only while registered)."},
        "revisions": {"type": "array", "description":
                      "During a rollout: the stage's pods per revision (pod template hash), the current one last.",
                      "items": {"type": "object", "properties": {
                          "revision": {"type": "string"}, "pods": {"type": "integer"},
                          "readyPods": {"type": "integer"}, "current": {"type": "boolean"}}}},
    },
}


def status_schema() -> Schema:
    return {
        "type": "object",
        "description": "Observed state, written by the operator.",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64",
                                   "description": "The metadata.generation this status describes."},
            "phase": {"type": "string", "description": "Pending, Progressing, Ready, Degraded or Invalid."},
            "message": {"type": "string", "description": "A one-line summary of what is not ready."},
            "readyStages": {"type": "string", "description": "Ready stages out of all, e.g. 3/3."},
            "endpoint": {"type": "string", "description": "URL of the OpenAI-compatible API inside the cluster."},
            "conditions": {
                "type": "array", "items": CONDITION,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
            },
            "stages": {
                "type": "array", "items": STAGE_STATUS,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            },
        },
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{C.PLURAL}.{C.GROUP}"},
        "spec": {
            "group": C.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": C.KIND, "listKind": f"{C.KIND}List", "plural": C.PLURAL, "singular": C.SINGULAR,
                "shortNames": C.SHORT_NAMES, "categories": C.CATEGORIES,
            },
            "versions": [{
                "name": C.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Ready", "type": "string", "jsonPath": ".status.readyStages",
                     "description": "Ready stages out of all"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A multi-stage omni-modality inference pipeline: a CPU master running the "
                                   "orchestrator and API, and a GPU fleet per stage.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `omnifleet crd` from the pydantic models; do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
