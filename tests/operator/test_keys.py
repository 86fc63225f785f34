"""The operator's side of the key contract: the internal key from <name>-internal-key reaches every
engine container as PAGODA_API_KEY and the router as PAGODA_BACKEND_API_KEY; the clients' keys of
spec.router.apiKeySecretRef are mounted whole into the router and passed as --api-key-file; a key
of the user's own for the engines is refused. (The handler's create-once: test_operator_kmock.)"""

from __future__ import annotations

import kubernetes_validate
import pytest

from pagoda_operator import crd
from pagoda_operator import render as r
from pagoda_operator.validation import check
from tests.operator.support import EXAMPLE_FILES, load_example, with_spec
from tests.packaging.pod_security import pod_templates


def _rendered(body: dict) -> list[dict]:
    checked = check(body)
    assert checked.renderable, checked.problems
    return r.render(body, checked.spec)


def _containers(manifests: list[dict], component: str) -> list[dict]:
    return [c for m in manifests if m["metadata"]["labels"]["app.kubernetes.io/component"] == component
            for _, pod in pod_templates(m) for c in pod["spec"]["containers"]]


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_every_engine_and_router_container_gets_the_internal_key(filename):
    body = load_example(filename)
    name = body["metadata"]["name"]
    manifests = _rendered(body)
    ref = {"secretKeyRef": {"name": f"{name}-internal-key", "key": "api-key"}}
    engines, routers = _containers(manifests, "engine"), _containers(manifests, "router")
    assert engines and routers
    for c in engines:  # leaders and workers of a LeaderWorkerSet too
        assert [e for e in c["env"] if e["name"] == "PAGODA_API_KEY"] == [{"name": "PAGODA_API_KEY", "valueFrom": ref}]
    for c in routers:
        assert [e for e in c["env"] if e["name"] == "PAGODA_BACKEND_API_KEY"] == [{"name": "PAGODA_BACKEND_API_KEY", "valueFrom": ref}]
    # Rendering only references the Secret (the handler creates it): no Secret among the children.
    assert "Secret" not in {m["kind"] for m in manifests}


def test_client_keys_are_mounted_whole_into_the_router_and_passed_as_a_file():
    body = with_spec(load_example("tiny-cpu.yaml"), router__apiKeySecretRef={"name": "client-keys"})
    (router,) = [m for m in _rendered(body) if m["kind"] == "Deployment" and m["metadata"]["name"] == "tiny"]
    pod = router["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][-2:] == ["--api-key-file", "/etc/pagoda/api-keys"]
    assert {"name": "api-keys", "secret": {"secretName": "client-keys"}} in pod["volumes"]
    # No subPath: kubelet swaps a mounted Secret's files when it changes, and the router re-reads them.
    assert {"name": "api-keys", "mountPath": "/etc/pagoda/api-keys", "readOnly": True} in c["volumeMounts"]
    kubernetes_validate.validate(router, "1.33.0", strict=True)
    # Without it the router takes requests without a key, and mounts nothing of the kind.
    (plain,) = [m for m in _rendered(load_example("tiny-cpu.yaml")) if m["kind"] == "Deployment" and m["metadata"]["name"] == "tiny"]
    assert "--api-key-file" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_internal_key_secret_the_handler_creates_is_owned_and_named_for_its_service():
    body = load_example("tiny-cpu.yaml", namespace="team-a", uid="1234-uid")
    secret = r.render_internal_key_secret(body, "s3cret")
    assert secret["metadata"]["name"] == "tiny-internal-key" and secret["metadata"]["namespace"] == "team-a"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
    assert secret["stringData"] == {"api-key": "s3cret"}
    kubernetes_validate.validate(secret, "1.33.0", strict=True)


@pytest.mark.parametrize("engine, problem", [
    ({"env": [{"name": "PAGODA_API_KEY", "value": "mine"}]}, "engine.env: PAGODA_API_KEY is set by the operator"),
    ({"extraArgs": ["--api-key", "mine"]}, "engine.extraArgs: --api-key would replace the key"),
    ({"extraArgs": ["--api-k=mine"]}, "engine.extraArgs: --api-key would replace the key"),  # argparse's abbreviation
], ids=["env", "flag", "abbreviated-flag"])
def test_a_key_of_the_users_own_for_the_engines_is_refused(engine, problem):
    checked = check(with_spec(load_example("tiny-cpu.yaml"), engine=engine))
    assert not checked.ok
    assert any(p.startswith(problem) for p in checked.problems), checked.problems


@pytest.mark.parametrize("router, problem", [
    ({"apiKeySecretRef": {"name": "Not_A_Name"}}, "spec.router.apiKeySecretRef.name"),
    ({"apiKeySecretRef": {}}, "spec.router.apiKeySecretRef.name: required"),
    ({"apiKeySecretRef": {"name": "k", "key": "token"}}, "spec.router.apiKeySecretRef.key: unknown field"),
], ids=["bad-name", "no-name", "a-key"])
def test_a_bad_api_key_secret_ref_is_refused_with_its_path(router, problem):
    checked = check(with_spec(load_example("tiny-cpu.yaml"), router=router))
    assert any(p.startswith(problem) for p in checked.problems), checked.problems


def test_the_crd_declares_the_new_fields():
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["networkPolicy"]["type"] == "boolean"
    ref = spec["router"]["properties"]["apiKeySecretRef"]
    assert ref["required"] == ["name"] and set(ref["properties"]) == {"name"}
    bad = check(with_spec(load_example("tiny-cpu.yaml"), networkPolicy="no"))
    assert "spec.networkPolicy: expected true or false, got 'no'" in bad.problems
