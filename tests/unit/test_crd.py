"""The checked-in CRD is the generated one, and it is structural."""

from __future__ import annotations

import yaml

from omnifleet_operator.crd import crd, crd_yaml

from ..conftest import REPO

CRD_FILE = REPO / "crds" / "omnifleet.dev_omnipipelines.yaml"


def test_checked_in_crd_is_current():
    assert CRD_FILE.read_text() == crd_yaml(), "crds/ is stale: run `omnifleet crd -o crds/omnifleet.dev_omnipipelines.yaml`"


def _walk(node, path="$"):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_schema_is_structural():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "$defs" not in node and "title" not in node, path
        assert "default" not in node or path.endswith(".properties"), path
        assert node.get("type") != "null", path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path


def test_every_spec_field_is_documented():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    undocumented = []
    for path, node in _walk(spec):
        for name, prop in (node.get("properties") or {}).items():
            if isinstance(prop, dict) and not prop.get("description"):
                undocumented.append(f"{path}.{name}")
    assert undocumented == []


def test_defaults_are_stated_in_descriptions():
    stage = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["stages"]["items"]
    assert "Default: 1." in stage["properties"]["gpus"]["description"]
    assert 'Default: "1Gi".' in stage["properties"]["shmSize"]["description"]


def test_cel_rules_are_present():
    rules = [r["rule"] for _, n in _walk(crd()) for r in n.get("x-kubernetes-validations", [])]
    assert any("exists_one" in r for r in rules)  # unique stage names
    assert any("minReplicas <= self.maxReplicas" in r for r in rules)
    assert len(rules) >= 12


def test_names_and_columns():
    c = yaml.safe_load(CRD_FILE.read_text())
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == \
        ("OmniPipeline", "omnipipelines", ["omnip"], ["omnifleet"])
    version = c["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [col["name"] for col in version["additionalPrinterColumns"]] == ["Ready", "Phase", "Age", "Message"]
