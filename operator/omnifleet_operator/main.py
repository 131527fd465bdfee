"""`make run`: the main job on the embedded default (the shipped samples)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from .checks import check_document
from .render import desired

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def main() -> int:
    failed = 0
    for path in sorted(SAMPLES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        doc, problems = check_document(yaml.safe_load(path.read_text()))
        if problems:
            failed += 1
            print(f"{path.name}: invalid")
            for p in problems:
                print(f"  {p}")
            continue
        objs = desired(doc)
        kinds = ", ".join(f"{k} x{n}" for k, n in _count(o["kind"] for o in objs).items())
        print(f"{path.name}: pipeline {doc.metadata.name!r}: {len(doc.spec.stages)} stages -> {len(objs)} objects ({kinds})")
    return 1 if failed else 0


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


if __name__ == "__main__":
    sys.exit(main())
