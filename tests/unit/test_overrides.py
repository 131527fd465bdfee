"""Dotlist overrides of pipeline files (`stages.talker.replicas=2`), in Python and through the CLI."""

from __future__ import annotations

import pytest
import yaml

from omnifleet_operator.checks import check_document
from omnifleet_operator.overrides import OverrideError, apply_overrides

from .test_cli import SAMPLES, omnifleet


def speech():
    return yaml.safe_load((SAMPLES / "speech.yaml").read_text())


def stage(doc, name):
    return next(s for s in doc["spec"]["stages"] if s["name"] == name)


def test_overrides_address_stages_by_name_and_parse_values():
    doc = speech()
    out = apply_overrides(doc, [
        "stages.talker.replicas=3",
        "stages.code2wav.engineArgs.factory_kwargs.seed=7",
        "stages.thinker.engineArgs={max_num_seqs: 8, enforce_eager: true}",
        "spec.model=/models/other",
        "stages.thinker.nodeSelector.gpu\\.vendor/model=h200",
        "stages.talker.autoscaling.maxReplicas=4",
        "stages.talker.inputs=[thinker]",
        "master.apiPort=9000",
    ])
    assert stage(out, "talker")["replicas"] == 3
    assert stage(out, "code2wav")["engineArgs"] == {"factory_kwargs": {"speaker": "Chelsie", "seed": 7}}
    # a mapping merges: the file's other engine args stay
    thinker = yaml.safe_load((SAMPLES / "speech.yaml").read_text())["spec"]["stages"][0]["engineArgs"]
    assert stage(out, "thinker")["engineArgs"] == {**thinker, "max_num_seqs": 8, "enforce_eager": True}
    assert thinker["max_num_seqs"] != 8
    assert out["spec"]["model"] == "/models/other"
    assert stage(out, "thinker")["nodeSelector"] == {"gpu.vendor/model": "h200"}
    assert stage(out, "talker")["autoscaling"] == {"maxReplicas": 4}
    assert out["spec"]["master"] == {"apiPort": 9000}
    assert stage(doc, "talker")["replicas"] == 2  # the input is not changed
    # the values are then validated as usual: replicas and autoscaling together are refused
    _, problems = check_document(out)
    assert [str(p) for p in problems] == ["spec.stages[1].autoscaling: set replicas or autoscaling, not both"]


@pytest.mark.parametrize("item,fragment", [
    ("stages.talkr.replicas=2", "no stage named 'talkr' (stages: thinker, talker, code2wav)"),
    ("stages.talker.replica=2", "spec.stages[talker] has no field 'replica' (fields: affinity, autoscaling,"),
    ("stages.talker.inputs.0=x", "spec.stages[talker].inputs is a single value or a list; set it whole"),
    ("stages.talker.autoscaling.max=3", "spec.stages[talker].autoscaling has no field 'max'"),
    ("stages=[]", "address a stage by name"),
    ("replicas=2", "spec has no field 'replicas'"),
    ("stages.talker", "expected PATH=VALUE"),
    ("stages.talker=3", "name a field of stage 'talker'"),
])
def test_bad_override_paths_are_named(item, fragment):
    with pytest.raises(OverrideError) as err:
        apply_overrides(speech(), [item])
    assert fragment in str(err.value)
    assert repr(item) in str(err.value)


def test_cli_render_and_validate_take_overrides():
    r = omnifleet("render", "-f", str(SAMPLES / "speech.yaml"), "stages.talker.replicas=5")
    assert r.returncode == 0, r.stderr
    deps = {o["metadata"]["name"]: o for o in yaml.safe_load_all(r.stdout) if o["kind"] == "Deployment"}
    assert deps["speech-talker"]["spec"]["replicas"] == 5 and deps["speech-thinker"]["spec"]["replicas"] == 2
    r = omnifleet("validate", "-f", str(SAMPLES / "speech.yaml"), "stages.talker.engineArgs.gpu_memory_utilization=0.6",
                  "stages.code2wav.engineArgs.gpu_memory_utilization=0.5")
    assert r.returncode == 1
    assert "ask for talker 0.6 + code2wav 0.5 = 1.10 > 1.0" in r.stderr
    r = omnifleet("validate", "-f", str(SAMPLES / "speech.yaml"), "stages.vocoder.replicas=1")
    assert r.returncode == 1 and "override 'stages.vocoder.replicas=1': no stage named 'vocoder'" in r.stderr
