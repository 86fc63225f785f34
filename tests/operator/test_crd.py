"""The generated CRD: up to date in crds/ and the chart, a valid structural CRD, and every
example valid against its schema."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagoda_operator import crd
from tests.operator.support import EXAMPLE_FILES, REPO, load_example


@pytest.mark.parametrize("directory,with_kustomization", [("crds", True), ("charts/pagoda/crds", False)])
def test_committed_crds_are_up_to_date(directory, with_kustomization):
    for filename, text in crd.expected_files(with_kustomization).items():
        path = REPO / directory / filename
        assert path.is_file(), f"{path.relative_to(REPO)} is missing: run `make crds`"
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run `make crds`"


def test_kustomization_lists_the_crd():
    kustomization = yaml.safe_load((REPO / "crds" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [crd.CRD_FILENAME]


def test_crd_is_a_valid_custom_resource_definition():
    kubernetes_validate.validate(crd.crd(), "1.33.0", strict=True)


def test_crd_names_subresources_and_columns():
    spec = crd.crd()["spec"]
    assert spec["group"] == "pagoda.dev"
    assert spec["names"]["shortNames"] == ["pis"] and spec["names"]["categories"] == ["pagoda"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector"}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Model", "Replicas", "Ready", "URL", "Age"]


def _walk(schema: dict, path: str):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """Every node has a type (int-or-string nodes excepted), as apiextensions/v1 demands."""
    root = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root, ""):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), path
        if node.get("type") == "object" and path not in ("", ".metadata"):
            assert "properties" in node or "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields"), path


def _validator():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)  # OpenAPI v3.0 schemas are draft 4 (boolean exclusiveMinimum)


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_example_is_valid_against_the_crd_schema(filename):
    errors = sorted(_validator().iter_errors(load_example(filename)), key=str)
    assert errors == []


@pytest.mark.parametrize("path,value", [
    (("topology", "tensor"), 0),
    (("router", "policy"), "random"),
    (("model", "uri"), "gs://bucket/model"),
    (("kvCache", "tiers"), [{"size": "1Gi"}]),
    (("resources", "memory"), "lots"),
])
def test_crd_schema_rejects_what_parsing_rejects(path, value):
    body = load_example("llama-3.1-8b.yaml")
    target = body["spec"]
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    assert list(_validator().iter_errors(body))
