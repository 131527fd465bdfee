"""The `omnifleet` command, run as a real process."""

from __future__ import annotations

import subprocess
import sys

import yaml

from ..conftest import REPO

SAMPLES = REPO / "manifests" / "samples"


def omnifleet(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnifleet_operator.cli", *args], input=stdin,
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_validate_valid_files():
    r = omnifleet("validate", "-f", str(SAMPLES / "speech.yaml"), "-f", str(SAMPLES / "single.yaml"))
    assert r.returncode == 0, r.stderr
    assert "speech.yaml: valid: pipeline 'speech', 3 stage(s), 2 pod group(s)" in r.stdout


def test_validate_reports_every_problem_with_its_path():
    doc = yaml.safe_load((SAMPLES / "speech.yaml").read_text())
    doc["spec"]["stages"][1]["inputs"] = ["thinkr"]
    doc["spec"]["stages"][2]["gpus"] = 1
    r = omnifleet("validate", "-f", "-", stdin=yaml.safe_dump(doc))
    assert r.returncode == 1
    assert "spec.stages[1].inputs[0]: no stage named 'thinkr'" in r.stderr
    assert "spec.stages[2].gpus: a co-located stage shares its host's gpus" in r.stderr


def test_validate_rejects_broken_yaml():
    r = omnifleet("validate", "-f", "-", stdin="spec: [unclosed")
    assert r.returncode != 0 and "not valid YAML" in r.stderr


def test_render_prints_the_operator_objects():
    r = omnifleet("render", "-f", str(SAMPLES / "autoscaled.yaml"), "-n", "ml")
    assert r.returncode == 0, r.stderr
    objs = list(yaml.safe_load_all(r.stdout))
    kinds = sorted(o["kind"] for o in objs)
    assert kinds.count("Deployment") == 3 and "HorizontalPodAutoscaler" in kinds
    assert {o["metadata"]["namespace"] for o in objs} == {"ml"}


def test_render_refuses_invalid():
    doc = yaml.safe_load((SAMPLES / "single.yaml").read_text())
    doc["spec"]["stages"][0]["finalOutput"] = "none"
    r = omnifleet("render", "-f", "-", stdin=yaml.safe_dump(doc))
    assert r.returncode == 1 and "at least one stage must have a finalOutput" in r.stderr
    assert r.stdout == ""
