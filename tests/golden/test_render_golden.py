"""Whole rendered output of each sample pipeline, pinned in golden files.

Regenerate with `make test-golden-update` (pytest --update-golden) and read the diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnifleet_operator.checks import check_document
from omnifleet_operator.render import desired
from omnifleet_operator.yamlfmt import dump_all

from ..conftest import REPO

SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))
SAMPLES = [p for p in SAMPLES if p.name != "kustomization.yaml"]
GOLDEN = Path(__file__).parent / "data"
OWNER_UID = "00000000-0000-4000-8000-000000000001"


def test_every_required_sample_exists():
    assert {p.stem for p in SAMPLES} >= {"speech", "image", "single", "autoscaled"}


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_rendered_sample_matches_golden(sample: Path, update_golden: bool):
    parsed, problems = check_document(yaml.safe_load(sample.read_text()))
    assert problems == []
    text = dump_all(desired(parsed, owner_uid=OWNER_UID))
    golden = GOLDEN / f"{sample.stem}.yaml"
    if update_golden:
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run pytest --update-golden"
    assert text == golden.read_text(), f"{sample.name} renders differently from {golden.name}; " \
        "if intended, regenerate with --update-golden and review the diff"
