"""Case 1: the CRD is accepted, `kubectl explain` shows the schema's docs, `kubectl get` its columns."""

from __future__ import annotations

import re

from omnifleet_runtime.schema import PipelineSpec, Stage

from .kube import Kube, load_sample, weights, with_namespace


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_crd_is_established_and_structural(kube: Kube):
    crd = kube.request("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/omnipipelines.omnifleet.dev")
    conds = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conds["Established"]["status"] == "True"
    assert conds["NamesAccepted"]["status"] == "True"
    assert "NonStructuralSchema" not in conds
    assert crd["spec"]["names"]["shortNames"] == ["omnip"]


def test_kubectl_explain_shows_field_docs(kube: Kube, operator):
    out = _flat(kube.kubectl("explain", "omnipipeline.spec.stages").stdout)
    # Descriptions come from the pydantic models (schema.py), through the generated CRD.
    for doc in (PipelineSpec.model_fields["stages"].description,
                Stage.model_fields["name"].description,
                Stage.model_fields["engine_args"].description,
                Stage.model_fields["colocate_with"].description):
        assert _flat(doc) in out, f"{doc!r} not in kubectl explain output:\n{out}"
    out = _flat(kube.kubectl("explain", "omnipipeline.spec.stages.gpus").stdout)
    assert _flat(Stage.model_fields["gpus"].description) in out


def test_kubectl_get_printer_columns(kube: Kube, operator, ns: str):
    weights(kube, ns)
    kube.apply(with_namespace(load_sample("speech.yaml"), ns))
    kube.wait_ready(ns, "speech")
    lines = kube.kubectl("get", "omnip", "-n", ns).stdout.splitlines()
    assert lines[0].split() == ["NAME", "READY", "PHASE", "AGE"], lines
    row = lines[1].split()
    assert row[:3] == ["speech", "3/3", "Ready"], lines
    wide = kube.kubectl("get", "omnipipelines", "-n", ns, "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NAME", "READY", "PHASE", "AGE", "MESSAGE"], wide
