"""YAML output people can read: multi-line strings as literal blocks."""

from __future__ import annotations

from typing import Any, Iterable

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def dump_all(objs: Iterable[Any]) -> str:
    return yaml.dump_all(list(objs), Dumper=_Dumper, sort_keys=False, width=120)
