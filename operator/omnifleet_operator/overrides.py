"""Dotlist overrides of a pipeline file: `stages.talker.replicas=2`.

Each override is `PATH=VALUE`, parsed by omegaconf's dotlist grammar (so
`2` is an int, `0.5` a float, `[a,b]` a list, `{k: v}` a mapping, and a dot
inside a key is written `\\.`). Paths are relative to `spec` (a leading
`spec.` is allowed); `stages.NAME` addresses a stage by its name. Every path
is checked against the schema before anything is set, so a typo fails with
the override and the fields that exist named, instead of an "unknown field"
at a list index the user never wrote. Values are then checked by the usual
validation. Free-form fields (`engineArgs`, `samplingParams`, maps like
`nodeSelector`) take any key; a mapping value is merged key by key.
Pure: no I/O.
"""

from __future__ import annotations

import copy
import types
import typing
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel

from omnifleet_runtime.schema import PipelineSpec, Stage


class OverrideError(ValueError):
    """A bad override; the message names it."""


def _parse(item: str) -> list[tuple[list[str], Any]]:
    """(key path, value) for each leaf the dotlist item sets."""
    if "=" not in item:
        raise OverrideError(f"override {item!r}: expected PATH=VALUE, e.g. stages.talker.replicas=2")
    try:
        tree = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except OmegaConfBaseException as e:
        raise OverrideError(f"override {item!r}: {str(e).splitlines()[0]}") from None
    out: list[tuple[list[str], Any]] = []

    def walk(node: Any, path: list[str]) -> None:
        if isinstance(node, dict) and node:  # a mapping value merges key by key
            for k, v in node.items():
                walk(v, path + [str(k)])
        else:
            out.append((path, node))

    walk(tree, [])
    if out and out[0][0] and out[0][0][0] == "spec":
        out = [(p[1:], v) for p, v in out]
    return out


def _unwrap(annotation: Any) -> Any:
    """X from Optional[X] / Annotated[X, ...]."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0] if len(args) == 1 else annotation
            if len(args) != 1:
                return annotation
        else:
            return annotation


def _fields(model: type[BaseModel]) -> dict[str, tuple[str, Any]]:
    """wire name -> (python name, annotation); snake_case names are accepted too."""
    out = {}
    for name, info in model.model_fields.items():
        out[info.alias or name] = (name, info.annotation)
        out[name] = (name, info.annotation)
    return out


def _field_kind(path: list[str], stages: list[str] | None, item: str = "") -> str:
    """Walk the schema along path: 'free' (any keys below), 'leaf', or raise naming the bad part."""
    model: type[BaseModel] = PipelineSpec
    where = "spec"
    i = 0
    while i < len(path):
        key = path[i]
        fields = _fields(model)
        if key not in fields:
            known = sorted({info.alias or n for n, info in model.model_fields.items()})
            raise OverrideError(f"override {item!r}: {where} has no field {key!r} (fields: {', '.join(known)})")
        _, annotation = fields[key]
        where = f"{where}.{key}"
        if model is PipelineSpec and key == "stages":
            if i + 1 >= len(path):
                raise OverrideError(f"override {item!r}: address a stage by name, e.g. stages.talker.replicas=2")
            name = path[i + 1]
            if stages is not None and name not in stages:
                raise OverrideError(f"override {item!r}: no stage named {name!r} (stages: {', '.join(stages)})")
            model, where, i = Stage, f"spec.stages[{name}]", i + 2
            continue
        target = _unwrap(annotation)
        origin = typing.get_origin(target)
        if isinstance(target, type) and issubclass(target, BaseModel):
            model, i = target, i + 1
            continue
        if target is dict or origin is dict or target is Any:
            return "free"
        if i + 1 < len(path):
            raise OverrideError(f"override {item!r}: {where} is a single value or a list; set it whole "
                                f"({key}=VALUE or {key}=[A,B])")
        return "leaf"
    return "leaf"


def apply_overrides(doc: Any, overrides: list[str]) -> Any:
    """A copy of the pipeline document with the overrides set in its spec."""
    if not overrides:
        return doc
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        raise OverrideError("overrides need a pipeline document with a spec")
    doc = copy.deepcopy(doc)
    spec = doc["spec"]
    stage_list = spec.get("stages") if isinstance(spec.get("stages"), list) else []
    names = [s.get("name") for s in stage_list if isinstance(s, dict)]
    for item in overrides:
        for path, value in _parse(item):
            if not path:
                raise OverrideError(f"override {item!r}: empty path")
            _field_kind(path, names, item)
            if path[0] == "stages":
                node = stage_list[names.index(path[1])]
                rest = path[2:]
                if not rest:
                    raise OverrideError(f"override {item!r}: name a field of stage {path[1]!r}")
            else:
                node, rest = spec, path
            for key in rest[:-1]:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node[rest[-1]] = value
    return doc
