"""router.mode: gateway: the InferencePool, the Endpoint Picker's Deployment, Service and RBAC,
the HTTPRoute and the engines' KV events, rendered from examples/tiny-gateway.yaml; every object
of an upstream kind validated against the real CRD (schema and CEL rules, `crd_schema.py`); the
picker's arguments accepted by the real `pagoda epp`; the combinations not supported refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from crd_schema import validate

from pagoda_engine.config import config_from_args
from pagoda_engine import serve
from pagoda_engine.router import epp
from pagoda_operator import render
from pagoda_operator.validation import check

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-gateway.yaml"


def _body(**spec_changes) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"].update(namespace="team-a", uid="u")
    for key, value in spec_changes.items():
        body["spec"][key] = value if not isinstance(value, dict) else {**body["spec"].get(key, {}), **value}
    return body


def _rendered(body: dict) -> dict[tuple[str, str], dict]:
    checked = check(body)
    assert checked.ok, checked.problems
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render(body, checked.spec)}


def test_the_pool_and_the_route_validate_against_the_real_crds():
    objects = _rendered(_body())
    pool, route = objects[("InferencePool", "tiny-gw")], objects[("HTTPRoute", "tiny-gw")]
    for obj, crd in ((pool, "gaie.inferencepools.yaml"), (route, "gateway-api.httproutes.yaml")):
        result = validate(obj, crd)
        assert result.errors == [] and not result.rules_skipped, (result.errors, result.rules_skipped)
        assert result.rules_passed  # the CEL rules ran
    assert pool["spec"]["selector"]["matchLabels"] == objects[("Deployment", "tiny-gw-engine")]["spec"]["selector"][
        "matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": render.ENGINE_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "tiny-gw-epp", "port": {"number": render.EPP_PORT},
                                                 "failureMode": "FailClose"}
    service = objects[("Service", "tiny-gw-epp")]
    assert service["spec"]["ports"][0]["port"] == render.EPP_PORT
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                                         "kind": "InferencePool", "name": "tiny-gw"}]


def test_the_validator_catches_what_the_crd_refuses():
    pool = _rendered(_body())[("InferencePool", "tiny-gw")]
    pool["spec"]["endpointPickerRef"].pop("port")  # a Service needs its port: a CEL rule
    assert any("port is required" in e for e in validate(pool, "gaie.inferencepools.yaml").errors)
    pool["spec"]["targetPorts"] = []  # minItems
    assert validate(pool, "gaie.inferencepools.yaml").errors


def test_the_engines_publish_kv_events_the_picker_follows(tmp_path):
    objects = _rendered(_body())
    assert "--kv-events-config" in objects[("ConfigMap", "tiny-gw-engine")]["data"]["engine.json"]
    engine_args = render.engine_args("tiny-gw", check(_body()).spec)
    events = json.loads(engine_args[engine_args.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{render.KV_EVENTS_PORT}"
    assert events["replay_endpoint"] == f"tcp://*:{render.KV_EVENTS_REPLAY_PORT}"
    # The engine's own flag contract accepts them.
    engine_parser = argparse.ArgumentParser()
    serve.add_arguments(engine_parser)
    parsed = engine_parser.parse_args(engine_args)
    assert config_from_args(parsed).kv_events_config.enabled
    [container] = objects[("Deployment", "tiny-gw-epp")]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pagoda", "epp"]
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    picker_args = parser.parse_args(container["args"])
    # The objectives ConfigMap, where the picker's pod mounts it, holds what the operator rendered.
    mounted = f"{render.EPP_OBJECTIVES_DIR}/{render.EPP_OBJECTIVES_KEY}"
    assert picker_args.objectives_file == mounted
    assert {"name": "objectives", "mountPath": render.EPP_OBJECTIVES_DIR, "readOnly": True} in container["volumeMounts"]
    volumes = objects[("Deployment", "tiny-gw-epp")]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "objectives", "configMap": {"name": "tiny-gw-epp"}} in volumes
    data = objects[("ConfigMap", "tiny-gw-epp")]["data"]
    (tmp_path / render.EPP_OBJECTIVES_KEY).write_text(data[render.EPP_OBJECTIVES_KEY])
    picker_args.objectives_file = str(tmp_path / render.EPP_OBJECTIVES_KEY)
    epp._validate_args(picker_args)  # raises on anything pagoda epp refuses
    assert picker_args.flow_control_queue == 0  # router.gateway.flowControlQueue left out
    assert picker_args.kv_events_port == render.KV_EVENTS_PORT and picker_args.model == "pagoda-tiny"
    assert container["readinessProbe"]["grpc"] == {"port": render.EPP_PORT, "service": "readiness"}


def test_the_pools_objectives_reach_the_picker_with_flow_control(tmp_path):
    body = _body(router={"gateway": {"parentRefs": [{"name": "inference-gateway"}], "flowControlQueue": 64}})
    checked = check(body)
    assert checked.ok, checked.problems
    objects = {(o["kind"], o["metadata"]["name"]): o
               for o in render.render(body, checked.spec, objectives={"interactive": 10, "batch": -1})}
    [container] = objects[("Deployment", "tiny-gw-epp")]["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    picker_args = parser.parse_args(container["args"])
    path = tmp_path / render.EPP_OBJECTIVES_KEY
    path.write_text(objects[("ConfigMap", "tiny-gw-epp")]["data"][render.EPP_OBJECTIVES_KEY])
    picker_args.objectives_file = str(path)
    epp._validate_args(picker_args)
    assert picker_args.flow_control_queue == 64
    assert [picker_args.objectives.priority(n) for n in ("interactive", "batch", "other")] == [10, -1, 0]
    negative = _body(router={"gateway": {"flowControlQueue": -1}})
    assert not check(negative).ok and any("flowControlQueue" in p for p in check(negative).problems)


def test_an_inference_objective_names_the_pool_by_its_pool_ref():
    from pagoda_operator import objectives

    def objective(name: str, pool_ref: dict, priority=None) -> dict:
        spec = {"poolRef": pool_ref} | ({} if priority is None else {"priority": priority})
        return {"metadata": {"name": name}, "spec": spec}

    listed = [objective("a", {"name": "gw"}, 5), objective("b", {"name": "gw", "group": "inference.networking.k8s.io",
                                                                  "kind": "InferencePool"}),
              objective("c", {"name": "other"}, 9), objective("d", {"name": "gw", "group": "example.com"}, 1)]
    assert objectives.priorities(listed, "gw") == {"a": 5, "b": 0}  # unset priority: 0, the CRD's meaning
    # The objective as the llm-d CRD defines it validates against it.
    assert validate({"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
                     "metadata": {"name": "a", "namespace": "team-a"},
                     "spec": {"poolRef": {"name": "gw"}, "priority": 5}}, "llm-d.inferenceobjectives.yaml").errors == []


def test_the_pools_parents_conditions_are_what_status_copies():
    from pagoda_operator.pool_status import pool_status

    pool = {"status": {"parents": [{
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway",
                      "namespace": "infra"},
        "controllerName": "example.net/gateway-controller",
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                        "observedGeneration": 1, "lastTransitionTime": "2026-11-29T00:00:00Z"},
                       {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef",
                        "message": "no Service tiny-gw-epp", "observedGeneration": 1,
                        "lastTransitionTime": "2026-11-29T00:00:00Z"},
                       {"type": "SomethingElse", "status": "True", "reason": "X", "message": "",
                        "lastTransitionTime": "2026-11-29T00:00:00Z"}]}]}}
    # The pool as a gateway writes it is valid for the real CRD, status included.
    assert validate({"apiVersion": render.INFERENCE_POOL_API_VERSION, "kind": "InferencePool",
                     "metadata": {"name": "tiny-gw", "namespace": "team-a"},
                     "spec": _rendered(_body())[("InferencePool", "tiny-gw")]["spec"], **pool},
                    "gaie.inferencepools.yaml").errors == []
    status = pool_status(pool)
    assert status == {"parents": [{"name": "inference-gateway", "namespace": "infra", "kind": "Gateway", "conditions": [
        {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "", "observedGeneration": 1,
         "lastTransitionTime": "2026-11-29T00:00:00Z"},
        {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef", "message": "no Service tiny-gw-epp",
         "observedGeneration": 1, "lastTransitionTime": "2026-11-29T00:00:00Z"}]}]}
    assert pool_status({}) == {"parents": []}


def test_engines_with_offload_tiers_publish_kv_events_too():
    body = _body(kvCache={"tiers": [{"type": "cpu", "size": "1Gi"}]})
    engine_args = render.engine_args("tiny-gw", check(body).spec)
    assert "--kv-offload-cpu-gb" in engine_args and "--kv-events-config" in engine_args
    engine_parser = argparse.ArgumentParser()
    serve.add_arguments(engine_parser)
    config = config_from_args(engine_parser.parse_args(engine_args))  # validated: the engine takes both
    assert config.kv_events_config.enabled and config.kv_offload_enabled
    [container] = _rendered(body)[("Deployment", "tiny-gw-epp")]["spec"]["template"]["spec"]["containers"]
    assert "--kv-events-port" in container["args"]


def test_without_events_the_picker_scores_by_load():
    for changes in ({"engine": {"prefixCaching": False}},
                    {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "builtinTiny": False}}):
        body = _body(**changes)
        body["spec"]["resources"] = {"gpusPerPod": 1}
        objects = _rendered(body)
        [container] = objects[("Deployment", "tiny-gw-epp")]["spec"]["template"]["spec"]["containers"]
        assert "--kv-events-port" not in container["args"] and "--model" not in container["args"]


def test_network_policies_admit_the_gateway_and_the_picker():
    objects = _rendered(_body())
    engine = objects[("NetworkPolicy", "tiny-gw-engine")]["spec"]["ingress"]
    assert {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": render.ENGINE_PORT}]} in engine
    picker = {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": "tiny-gw",
              "app.kubernetes.io/component": "endpoint-picker"}
    assert {"from": [{"podSelector": {"matchLabels": picker}}],
            "ports": [{"protocol": "TCP", "port": render.KV_EVENTS_PORT},
                      {"protocol": "TCP", "port": render.KV_EVENTS_REPLAY_PORT}]} in engine
    epp_policy = objects[("NetworkPolicy", "tiny-gw-epp")]["spec"]
    assert epp_policy["podSelector"]["matchLabels"] == picker
    assert epp_policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": render.EPP_PORT}]
    builtin = _rendered(_body(router={"mode": "builtin", "gateway": None}))
    assert ("NetworkPolicy", "tiny-gw-epp") not in builtin and ("InferencePool", "tiny-gw") not in builtin


@pytest.mark.parametrize("router, topology, says", [
    ({"mode": "builtin"}, None, "router.gateway: set router.mode: gateway"),
    ({"apiKeySecretRef": {"name": "keys"}}, None, "router.apiKeySecretRef"),
    ({}, {"nodes": 2, "tensor": 2}, "topology.nodes > 1"),
])
def test_combinations_not_supported_are_refused(router, topology, says):
    body = _body(router=router)
    if topology:
        body["spec"]["topology"] = topology
    checked = check(body)
    assert not checked.ok and any(says in p for p in checked.problems), checked.problems


# --- the operator against the emulated API server ------------------------------------------------

POOL = ("inference.networking.k8s.io", "v1", "inferencepools")
ROUTE = ("gateway.networking.k8s.io", "v1", "httproutes")


def test_without_the_crds_the_service_is_degraded_then_gets_its_pool_and_route_once_installed(apiserver_missing_crds):
    from tests.operator.test_operator_kmock import IS, NS, children_of, conditions, create, get, wait_for

    apiserver = apiserver_missing_crds
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": "gw", "namespace": NS}
    create(apiserver, body)
    conds = wait_for("Degraded", lambda: conditions(get(apiserver, IS, "gw") or {}).get("Degraded")
                     and conditions(get(apiserver, IS, "gw")))
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "Multiple")  # both CRDs missing
    assert "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed" in conds["Degraded"]["message"]
    assert "the HTTPRoute CRD (gateway.networking.k8s.io/v1) is not installed" in conds["Degraded"]["message"]
    assert get(apiserver, ("apps", "v1", "deployments"), "gw-epp") and get(apiserver, ("", "v1", "services"), "gw-epp")
    assert ("Deployment", "gw-engine") in children_of(apiserver, "gw")  # the rest is applied
    apiserver.api.declare(*POOL, "InferencePool")
    apiserver.api.declare(*ROUTE, "HTTPRoute")
    pool = wait_for("the InferencePool", lambda: get(apiserver, POOL, "gw"))
    route = wait_for("the HTTPRoute", lambda: get(apiserver, ROUTE, "gw"))
    assert pool["spec"]["endpointPickerRef"]["name"] == "gw-epp"
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    wait_for("Degraded=False", lambda: conditions(get(apiserver, IS, "gw")).get("Degraded", {}).get("status") == "False")


OBJECTIVES = ("llm-d.ai", "v1alpha2", "inferenceobjectives")
CONFIGMAPS = ("", "v1", "configmaps")


@pytest.fixture
def gateway_cluster():
    """An API server with the InferencePool, HTTPRoute and InferenceObjective CRDs installed
    before the operator starts (so kopf watches pools and objectives), and the operator."""
    from tests.operator.apiserver import BackgroundApiServer
    from tests.operator.test_operator_kmock import Operator

    apiserver = BackgroundApiServer()
    apiserver.api.declare(*POOL, "InferencePool")
    apiserver.api.declare(*ROUTE, "HTTPRoute")
    apiserver.api.declare(*OBJECTIVES, "InferenceObjective")
    operator = Operator(apiserver)
    operator.start()
    yield apiserver
    operator.stop()
    apiserver.close()


def test_objectives_reach_the_pickers_configmap_and_the_pools_parents_reach_the_status(gateway_cluster):
    from tests.operator.test_operator_kmock import IS, NS, create, get, patch_spec, path_of, request, status_of, wait_for

    apiserver = gateway_cluster

    def objectives_in_configmap(name: str) -> dict | None:
        configmap = get(apiserver, CONFIGMAPS, f"{name}-epp")
        return json.loads(configmap["data"][render.EPP_OBJECTIVES_KEY]) if configmap else None

    def objective(name: str, pool: str, priority: int | None) -> dict:
        obj = {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective", "metadata": {"name": name, "namespace": NS},
               "spec": {"poolRef": {"name": pool}} | ({} if priority is None else {"priority": priority})}
        assert validate(obj, "llm-d.inferenceobjectives.yaml").errors == []
        return obj

    # One objective exists before the service: the first reconcile hands it over.
    request(apiserver, "POST", path_of(OBJECTIVES), objective("interactive", "gw", 10))
    request(apiserver, "POST", path_of(OBJECTIVES), objective("elsewhere", "other-pool", 3))
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": "gw", "namespace": NS}
    create(apiserver, body)
    wait_for("the first objective", lambda: objectives_in_configmap("gw") == {"interactive": 10})
    epp = wait_for("the picker", lambda: get(apiserver, ("apps", "v1", "deployments"), "gw-epp"))
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--objectives-file") + 1] == f"{render.EPP_OBJECTIVES_DIR}/{render.EPP_OBJECTIVES_KEY}"

    # Created, changed and deleted afterwards: the ConfigMap follows without a spec change.
    request(apiserver, "POST", path_of(OBJECTIVES), objective("batch", "gw", None))
    wait_for("a new objective", lambda: objectives_in_configmap("gw") == {"interactive": 10, "batch": 0})
    request(apiserver, "PATCH", path_of(OBJECTIVES, "batch"), {"spec": {"priority": -2}}, "application/merge-patch+json")
    wait_for("a changed priority", lambda: objectives_in_configmap("gw") == {"interactive": 10, "batch": -2})
    request(apiserver, "DELETE", path_of(OBJECTIVES, "interactive"))
    wait_for("a deleted objective", lambda: objectives_in_configmap("gw") == {"batch": -2})

    # A gateway takes the pool up: its verdicts show on the InferenceService.
    wait_for("the pool", lambda: get(apiserver, POOL, "gw"))
    parents = [{"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"},
                "controllerName": "example.net/gateway-controller",
                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                                "observedGeneration": 1, "lastTransitionTime": "2026-11-29T00:00:00Z"},
                               {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs", "message": "",
                                "observedGeneration": 1, "lastTransitionTime": "2026-11-29T00:00:00Z"}]}]
    request(apiserver, "PATCH", path_of(POOL, "gw", "status"), {"status": {"parents": parents}},
            "application/merge-patch+json")
    shown = wait_for("the pool's parents in the status",
                     lambda: (status_of(apiserver, "gw").get("inferencePool") or {}).get("parents"))
    assert shown == [{"name": "inference-gateway", "kind": "Gateway",
                      "conditions": [{k: c[k] for k in ("type", "status", "reason", "message", "observedGeneration",
                                                         "lastTransitionTime")} for c in parents[0]["conditions"]]}]
    parents[0]["conditions"][1].update(status="False", reason="InvalidExtensionRef", message="no Service gw-epp")
    request(apiserver, "PATCH", path_of(POOL, "gw", "status"), {"status": {"parents": parents}},
            "application/merge-patch+json")
    wait_for("ResolvedRefs=False in the status", lambda: status_of(apiserver, "gw")["inferencePool"]["parents"][0][
        "conditions"][1]["status"] == "False")
    # The reconciler's own conditions stay beside the copied ones.
    assert {c["type"] for c in status_of(apiserver, "gw")["conditions"]} >= {"Ready", "Validated"}
    assert get(apiserver, IS, "gw")["status"]["inferencePool"]["parents"][0]["name"] == "inference-gateway"

    # Back to the router alone: the pool is pruned, and its parents leave the status.
    patch_spec(apiserver, "gw", {"router": {"mode": "builtin", "gateway": None}})
    wait_for("the pool pruned", lambda: get(apiserver, POOL, "gw") is None)
    wait_for("status.inferencePool gone", lambda: "inferencePool" not in status_of(apiserver, "gw"))
