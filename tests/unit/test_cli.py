"""The `omnifleet` command, run as a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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


ALL_SAMPLES = sorted(SAMPLES.rglob("*.yaml"))


def test_every_shipped_sample_validates_with_its_callables():
    files = [p for p in ALL_SAMPLES if p.name != "kustomization.yaml"]
    assert len(files) >= 6
    # The python-code sample's own module ships beside it (in a ConfigMap on a cluster).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SAMPLES / "python-code"), *sys.path])}
    r = subprocess.run([sys.executable, "-m", "omnifleet_operator.cli", "validate",
                        *(a for f in files for a in ("-f", str(f)))], capture_output=True, text=True, cwd=REPO,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    # Every callable a sample names is the runtime's own, so each one was imported and checked.
    assert "not checked" not in r.stdout, r.stdout
    assert r.stdout.count(": valid: ") == len(files)


def test_validate_names_a_callable_that_does_not_exist():
    doc = yaml.safe_load((SAMPLES / "autoscaled.yaml").read_text())
    doc["spec"]["stages"][0]["entrypoint"] = "omnifleet_runtime.processors:passthrough"
    doc["spec"]["stages"][1]["inputProcessor"] = "omnifleet_runtime.processors:llm_txt"
    doc["spec"]["stages"][0]["promptExpand"] = "omnifleet_runtime.processors:negative_prompts"
    r = omnifleet("validate", "-f", "-", stdin=yaml.safe_dump(doc))
    assert r.returncode == 1
    assert "spec.stages[0].promptExpand: 'omnifleet_runtime.processors' has no 'negative_prompts'" in r.stderr
    assert "spec.stages[0].entrypoint: 'omnifleet_runtime.processors' has no 'passthrough'" in r.stderr
    assert "spec.stages[1].inputProcessor: 'omnifleet_runtime.processors' has no 'llm_txt'" in r.stderr
    # --no-import leaves the callables alone.
    assert omnifleet("validate", "--no-import", "-f", "-", stdin=yaml.safe_dump(doc)).returncode == 0


def test_validate_says_which_callables_it_could_not_check():
    doc = yaml.safe_load((SAMPLES / "autoscaled.yaml").read_text())
    doc["spec"]["stages"][0]["entrypoint"] = "acme_prep.stages:normalize"
    r = omnifleet("validate", "-f", "-", stdin=yaml.safe_dump(doc))
    assert r.returncode == 0, r.stderr
    assert ("not checked: spec.stages[0].entrypoint: acme_prep.stages:normalize "
            "(module 'acme_prep.stages' is not installed here)") in r.stdout


def test_images_are_named_with_the_project_version():
    import tomllib

    from omnifleet_runtime import constants as C

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert C.PROJECT_VERSION == version
    assert C.DEFAULT_IMAGE.endswith(f":{version}") and C.OPERATOR_IMAGE.endswith(f":{version}")
    assert f"image: {C.OPERATOR_IMAGE}" in (REPO / "manifests" / "operator.yaml").read_text()


def test_dashboard_of_one_pipeline_has_its_name_and_stages_in_order():
    import json

    r = omnifleet("dashboard", "-f", str(SAMPLES / "speech.yaml"))
    assert r.returncode == 0, r.stderr
    board = json.loads(r.stdout)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert board["uid"] == "omnifleet-speech"
    assert variables["pipeline"]["current"]["value"] == "speech"
    assert [o["value"] for o in variables["stage"]["options"]] == ["thinker", "talker", "code2wav"]
    bad = omnifleet("dashboard", "-f", "-", stdin="apiVersion: omnifleet.dev/v1alpha1\nkind: OmniPipeline\n"
                                                  "metadata: {name: x}\nspec: {stages: []}\n")
    assert bad.returncode == 1 and "spec.stages" in bad.stderr


def test_the_masters_drain_linger_comes_from_its_environment_and_a_bad_value_is_named(monkeypatch):
    from omnifleet_runtime import commands
    from omnifleet_runtime import constants as C

    monkeypatch.delenv(C.ENV_DRAIN_LINGER, raising=False)
    assert commands._seconds(None, C.ENV_DRAIN_LINGER, C.MASTER_DRAIN_LINGER_S) == C.MASTER_DRAIN_LINGER_S
    monkeypatch.setenv(C.ENV_DRAIN_LINGER, "15")
    assert commands._seconds(None, C.ENV_DRAIN_LINGER, C.MASTER_DRAIN_LINGER_S) == 15.0
    assert commands._seconds(2.0, C.ENV_DRAIN_LINGER, C.MASTER_DRAIN_LINGER_S) == 2.0  # the flag wins
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(C.ENV_DRAIN_LINGER, bad)
        with pytest.raises(SystemExit, match=f"{C.ENV_DRAIN_LINGER}=.*number of seconds"):
            commands._seconds(None, C.ENV_DRAIN_LINGER, C.MASTER_DRAIN_LINGER_S)
