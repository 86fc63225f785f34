"""spec.prefill: disaggregated prefill and decode, rendered from examples/tiny-disagg.yaml (a
Deployment, headless Service and budget per llm-d.ai/role; the prefill pods kv_producer on their
own address, the decode pods kv_consumer; the router on both Services), every manifest checked
against Kubernetes' schemas, the engine flags taken by the real `pagoda serve` configuration, the
refusals of what cannot exchange pages, and the per-role status through the emulated API server."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagoda_engine import serve
from pagoda_engine.config import config_from_args
from pagoda_engine.kv_transfer import DEFAULT_KV_PORT
from pagoda_operator import render
from pagoda_operator.spec import parse_spec
from pagoda_operator.validation import check
from tests.operator.support import load_example, with_spec
from tests.operator.test_engine_contract import POD_IP, _parser, pod_args
from tests.operator.test_operator_kmock import cluster  # noqa: F401  (the emulated API server and the operator)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-disagg.yaml"
ROLE = "llm-d.ai/role"


def _body(**spec_changes) -> dict:
    return with_spec(load_example("tiny-disagg.yaml", namespace="team-a", uid="u"), **spec_changes)


def _rendered(body: dict) -> dict[tuple[str, str], dict]:
    checked = check(body)
    assert checked.ok, checked.problems
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render(body, checked.spec)}


def _container(objects: dict, role: str) -> dict:
    (container,) = objects[("Deployment", f"tiny-pd-{role}")]["spec"]["template"]["spec"]["containers"]
    return container


def _engine_config(container: dict):
    parser = _parser(serve.add_arguments)
    return config_from_args(parser.parse_args(pod_args(container, "engine")))


def test_each_role_is_a_deployment_service_and_budget_of_its_own_pods():
    objects = _rendered(_body())
    for manifest in objects.values():
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    assert ("Deployment", "tiny-pd-engine") not in objects and ("Service", "tiny-pd-engine") not in objects
    for role, replicas in (("prefill", 1), ("decode", 2)):
        deployment = objects[("Deployment", f"tiny-pd-{role}")]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector[ROLE] == role and deployment["metadata"]["labels"][ROLE] == role
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert deployment["spec"]["replicas"] == replicas
        service = objects[("Service", f"tiny-pd-{role}")]["spec"]
        assert service["selector"] == selector and service["clusterIP"] == "None"
        assert objects[("PodDisruptionBudget", f"tiny-pd-{role}")]["spec"]["selector"]["matchLabels"] == selector
    # The two Deployments' selectors are disjoint: neither adopts the other's pods.
    prefill_pod = objects[("Deployment", "tiny-pd-prefill")]["spec"]["template"]["metadata"]["labels"]
    decode_selector = objects[("Deployment", "tiny-pd-decode")]["spec"]["selector"]["matchLabels"]
    assert not decode_selector.items() <= prefill_pod.items()
    # spec.prefill's own fields reach the prefill pods only.
    assert _container(objects, "prefill")["resources"]["requests"]["cpu"] == "2"
    assert _container(objects, "decode")["resources"]["requests"]["cpu"] == "1"
    assert _engine_config(_container(objects, "prefill")).scheduler.max_num_batched_tokens == 2048
    assert _engine_config(_container(objects, "decode")).scheduler.max_num_batched_tokens != 2048


def test_prefill_pods_produce_on_their_own_address_and_decode_pods_consume():
    assert render.KV_TRANSFER_PORT == DEFAULT_KV_PORT
    body = _body(topology={"data": 2})
    objects = _rendered(body)
    prefill, decode = _container(objects, "prefill"), _container(objects, "decode")
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in prefill["env"]
    produced = _engine_config(prefill).kv_transfer_config
    assert (produced.kv_role, produced.kv_ip, produced.kv_port) == ("kv_producer", POD_IP, DEFAULT_KV_PORT)
    # Engine core r answers on kv_port + r: each is a container port.
    assert [p["containerPort"] for p in prefill["ports"] if p["name"].startswith("kv-transfer")] == [14579, 14580]
    consumed = _engine_config(decode).kv_transfer_config
    assert consumed.kv_role == "kv_consumer"
    assert "POD_IP" not in {e["name"] for e in decode["env"]} and [p["name"] for p in decode["ports"]] == ["http"]


def test_the_router_discovers_each_role_through_its_service():
    from pagoda_engine.router import app as router_app

    objects = _rendered(_body())
    (container,) = objects[("Deployment", "tiny-pd")]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--prefill-k8s-service") + 1] == "team-a/tiny-pd-prefill"
    assert args[args.index("--decode-k8s-service") + 1] == "team-a/tiny-pd-decode"
    assert "--k8s-service" not in args
    parsed = _parser(router_app.add_arguments).parse_args(args)
    router_app._validate_args(parsed)  # raises on anything pagoda route refuses
    assert parsed.prefill_k8s == ("team-a", "tiny-pd-prefill")


def _admits(policy: dict, source_labels: dict, target_labels: dict, port: int) -> bool:
    """NetworkPolicy semantics for a pod of the same namespace: does a rule let `source` reach
    `target` on TCP `port`?"""
    spec = policy["spec"]
    if not spec["podSelector"]["matchLabels"].items() <= target_labels.items():
        return False
    for rule in spec["ingress"]:
        peers = [p for p in rule.get("from", []) if "namespaceSelector" not in p]
        if not any(p["podSelector"]["matchLabels"].items() <= source_labels.items() for p in peers):
            continue
        ports = rule.get("ports")
        if ports is None or any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in ports):
            return True
    return False


@pytest.mark.parametrize("port", [render.KV_TRANSFER_PORT, 40123])  # the handshake, and an ephemeral port (gloo, UCX)
def test_decode_pods_reach_prefill_pods_on_any_tcp_port(port):
    objects = _rendered(_body())
    policy = objects[("NetworkPolicy", "tiny-pd-engine")]
    pod = {role: objects[("Deployment", f"tiny-pd-{role}")]["spec"]["template"]["metadata"]["labels"] for role in ("prefill", "decode")}
    router = objects[("Deployment", "tiny-pd")]["spec"]["template"]["metadata"]["labels"]
    assert _admits(policy, pod["decode"], pod["prefill"], port)
    assert _admits(policy, router, pod["prefill"], render.ENGINE_PORT)
    assert not _admits(policy, router, pod["prefill"], port)


def _prefill(**fields) -> dict:
    prefill = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"]["prefill"])
    for key, value in fields.items():
        prefill.setdefault("engine", {})[key] = value
    return prefill


@pytest.mark.parametrize("changes, says", [
    ({"prefill": _prefill(extraArgs=["--block-size", "32"])}, "prefill.engine.extraArgs --block-size: both roles must share it"),
    ({"prefill": _prefill(extraArgs=["--dtype", "float16"])}, "prefill.engine.extraArgs --dtype"),
    ({"prefill": _prefill(extraArgs=["--model", "/elsewhere"])}, "set model.uri instead"),
    ({"prefill": _prefill(extraArgs=["--quantization", "fp8"])}, "prefill.engine.extraArgs --quantization"),
    ({"prefill": _prefill(kvCacheDtype="fp8")}, "prefill.engine.kvCacheDtype: fp8 differs from engine.kvCacheDtype auto"),
    ({"prefill": _prefill(prefixCaching=False)}, "prefill.engine.prefixCaching: must stay true"),
    ({"engine": {"prefixCaching": False}}, "engine.prefixCaching: spec.prefill needs the prefix cache"),
    ({"engine": {"extraArgs": ["--kv-transfer-config", '{"kv_role":"kv_both"}']}}, "engine.extraArgs --kv-transfer-config"),
    ({"topology": {"tensor": 2}}, "topology: spec.prefill needs tensor 1 and pipeline 1"),
    ({"topology": {"pipeline": 2}}, "topology: spec.prefill needs tensor 1 and pipeline 1"),
    ({"topology": {"nodes": 2}}, "topology.nodes: spec.prefill needs one node per replica"),
    ({"router": {"mode": "gateway"}}, "router.mode: gateway with spec.prefill"),
    ({"prefill": _prefill(extraArgs=["--no-such-flag"])}, "prefill: engine.extraArgs: pagoda serve has no flag --no-such-flag"),
    ({"prefill": {"resources": {"gpusPerPod": 0, "cpu": "1"}, "engine": {"apiServerCount": 4}}},
     "prefill: engine: apiServerCount 4 needs at least 4 CPUs per pod"),
])
def test_what_cannot_exchange_pages_is_refused_naming_the_field(changes, says):
    body = _body()
    for key, value in changes.items():
        if value is None:
            body["spec"].pop(key, None)
        else:
            body["spec"][key] = value
    checked = check(body)
    assert not checked.ok and any(says in p for p in checked.problems), checked.problems


def test_a_name_too_long_for_the_prefill_service_is_refused():
    body = _body()
    body["metadata"]["name"] = "p" + "d" * 55  # fits <name>-engine, not <name>-prefill
    checked = check(body)
    assert any("metadata.name" in p and "-prefill" in p for p in checked.problems), checked.problems
    assert check(_body(prefill=None) | {"metadata": body["metadata"]}).ok


def test_kv_transfer_config_is_the_operators_without_spec_prefill_too():
    body = _body(prefill=None, engine={"extraArgs": ["--kv-transfer-config", '{"kv_role":"kv_producer"}']})
    checked = check(body)
    assert any("engine.extraArgs --kv-transfer-config: set by the operator with spec.prefill" in p for p in checked.problems)


# --- the operator against the emulated API server ------------------------------------------------


def test_the_status_reports_each_roles_replicas_and_ready_waits_for_both(cluster):
    from tests.operator.test_operator_kmock import IS, NS, children_of, conditions, create, get, mark_rolled_out, \
        status_of, wait_for

    apiserver, _ = cluster
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": "pd", "namespace": NS}
    create(apiserver, body)
    expected = {("Deployment", "pd-prefill"), ("Deployment", "pd-decode"), ("Service", "pd-prefill"),
                ("Service", "pd-decode"), ("Deployment", "pd")}
    children = wait_for("children", lambda: expected <= set(c := children_of(apiserver, "pd")) and c)
    assert ("Deployment", "pd-engine") not in children
    mark_rolled_out(apiserver, "pd", 1)
    mark_rolled_out(apiserver, "pd-decode", 2)
    status = wait_for("the decode pods counted",
                      lambda: (s := status_of(apiserver, "pd")).get("readyReplicas") == 2 and s)
    assert status["roles"] == [{"name": "prefill", "replicas": 0, "readyReplicas": 0},
                               {"name": "decode", "replicas": 2, "readyReplicas": 2}]
    assert status["selector"].split(",") == sorted(status["selector"].split(",")) and f"{ROLE}=decode" in status["selector"]
    conds = conditions(get(apiserver, IS, "pd"))
    ready = conds["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasNotReady")
    assert (conds["Progressing"]["status"], conds["Progressing"]["reason"]) == ("True", "RollingOut")
    assert ready["message"] == "2/2 decode and 0/1 prefill replicas ready."
    mark_rolled_out(apiserver, "pd-prefill", 1)
    ready = wait_for("Ready", lambda: (c := conditions(get(apiserver, IS, "pd"))["Ready"])["status"] == "True" and c)
    assert ready["message"] == "2/2 decode and 1/1 prefill replicas ready."
    wait_for("RolloutComplete", lambda: conditions(get(apiserver, IS, "pd"))["Progressing"]["reason"] == "RolloutComplete")
    assert status_of(apiserver, "pd")["roles"][0] == {"name": "prefill", "replicas": 1, "readyReplicas": 1}


def test_the_kv_tiers_figures_are_read_from_both_roles_services():
    import re

    from pagoda_operator import kv_status

    objects = _rendered(_body())
    services = {n for (kind, n), o in objects.items() if kind == "Service" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"}
    assert services == {"tiny-pd-prefill", "tiny-pd-decode"}
    promql = kv_status.queries("team-a", "tiny-pd", disaggregated=True)["capacity"]
    (pattern,) = re.findall(r'service=~"([^"]+)"', promql)
    assert {s for s in services if re.fullmatch(pattern, s)} == services
    assert not re.fullmatch(pattern, "tiny-pd") and 'namespace="team-a"' in promql


def test_the_builtin_autoscaler_scales_the_decode_pods_on_their_own_metrics():
    from pagoda_operator.autoscaler.prometheus import queries

    body = _body(replicas=None, autoscaling={"maxReplicas": 4, "policy": "kvUtilization",
                                             "prometheusURL": "http://prometheus:9090"})
    objects = _rendered(body)
    assert objects[("Deployment", "tiny-pd-decode")]["spec"]["replicas"] == 1  # the floor: minReplicas
    assert objects[("Deployment", "tiny-pd-prefill")]["spec"]["replicas"] == 1  # prefill.replicas, unscaled
    promql = queries("kvUtilization", "team-a", "tiny-pd", role="decode")
    assert promql["kv_usage"] == 'avg(pagoda:kv_cache_usage_perc{namespace="team-a",service="tiny-pd-decode"})'
    assert 'service="tiny-pd-decode"' in promql["waiting"] and 'service="tiny-pd"' in promql["router_held"]


# --- spec.prefill.autoscaling ---------------------------------------------------------------------

PREFILL_AUTOSCALING = {"minReplicas": 1, "maxReplicas": 4, "policy": "queue", "target": 2,
                       "prometheusURL": "http://prometheus:9090"}


def _autoscaled_prefill(**autoscaling) -> dict:
    """The example with the prefill pods autoscaled (prefill.replicas left to the autoscaler)."""
    body = _body()
    prefill = body["spec"]["prefill"]
    del prefill["replicas"]
    prefill["autoscaling"] = {**PREFILL_AUTOSCALING, **autoscaling}
    return body


def _problems(body: dict) -> list[str]:
    checked = check(body)
    assert not checked.ok
    return checked.problems


def test_prefill_autoscaling_renders_its_floor_and_then_what_the_autoscaler_set():
    body = _autoscaled_prefill(minReplicas=2)
    assert _rendered(body)[("Deployment", "tiny-pd-prefill")]["spec"]["replicas"] == 2  # minReplicas
    assert _rendered(body)[("Deployment", "tiny-pd-decode")]["spec"]["replicas"] == 2  # spec.replicas, apart
    body["spec"]["prefill"]["replicas"] = 3
    body["metadata"]["managedFields"] = [
        {"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {"f:prefill": {"f:autoscaling": {}}}}},
        {"manager": "pagoda-autoscaler", "operation": "Update", "fieldsV1": {"f:spec": {"f:prefill": {"f:replicas": {}}}}},
    ]
    assert _rendered(body)[("Deployment", "tiny-pd-prefill")]["spec"]["replicas"] == 3
    # Without spec.prefill.autoscaling and replicas: one prefill replica, as before.
    plain = _body()
    del plain["spec"]["prefill"]["replicas"]
    assert _rendered(plain)[("Deployment", "tiny-pd-prefill")]["spec"]["replicas"] == 1


def test_prefill_replicas_set_by_a_user_beside_prefill_autoscaling_is_refused():
    body = _autoscaled_prefill()
    body["spec"]["prefill"]["replicas"] = 2
    says = "prefill.replicas: set prefill.replicas or prefill.autoscaling, not both"
    assert any(p.startswith(says) for p in _problems(body))  # no managedFields: written by hand
    body["metadata"]["managedFields"] = [
        {"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {"f:prefill": {"f:replicas": {}, "f:autoscaling": {}}}}}]
    assert any(p.startswith(says + " (set by kubectl)") for p in _problems(body))
    # spec.replicas of the decode pods is not prefill.replicas: the decode check stays quiet.
    assert not any(p.startswith("replicas:") for p in _problems(body))
    body["metadata"]["managedFields"] = [
        {"manager": "pagoda-autoscaler", "operation": "Update", "fieldsV1": {"f:spec": {"f:prefill": {"f:replicas": {}}}}}]
    assert check(body).ok, check(body).problems


@pytest.mark.parametrize("autoscaling, says", [
    ({"policy": "kvUtilization"}, "prefill.autoscaling.policy: kvUtilization does not measure prefill load: a prefill "
                                  "pod's KV pages in use are the prompts it holds until a decode pod pulls them"),
    ({"policy": "itl"}, "prefill.autoscaling.policy: itl does not measure prefill load: a prefill pod makes one token"),
    ({"minReplicas": 0}, "prefill.autoscaling.minReplicas: 0 could never scale back up"),
    ({"minReplicas": 3, "maxReplicas": 2}, "prefill.autoscaling: minReplicas 3 > maxReplicas 2"),
    ({"scaleDownDelay": "soon"}, "prefill.autoscaling.scaleDownDelay:"),
    ({"target": 0}, "spec.prefill.autoscaling.target"),  # the schema: > 0
    ({"target": -1.5}, "spec.prefill.autoscaling.target"),
    ({"policy": "latency"}, "spec.prefill.autoscaling.policy"),
])
def test_prefill_autoscaling_that_cannot_work_is_refused_naming_the_field(autoscaling, says):
    problems = _problems(_autoscaled_prefill(**autoscaling))
    assert any(says in p for p in problems), problems
    assert not any(p.startswith("prefill: autoscaling") for p in problems), problems  # named once, as prefill's


def test_prefill_replicas_outside_the_autoscaling_bounds_is_refused():
    body = _autoscaled_prefill(maxReplicas=2)
    body["spec"]["prefill"]["replicas"] = 3
    body["metadata"]["managedFields"] = [
        {"manager": "pagoda-autoscaler", "operation": "Update", "fieldsV1": {"f:spec": {"f:prefill": {"f:replicas": {}}}}}]
    assert "prefill.replicas: 3 is outside prefill.autoscaling's [1, 2]" in _problems(body)


def test_the_prefill_role_is_observed_on_its_own_pods_and_not_the_routers_queue():
    from pagoda_operator.autoscaler.prometheus import prometheus_url, queries

    promql = queries("queue", "team-a", "tiny-pd", role="prefill")
    assert set(promql) == {"waiting", "running"}
    assert promql["waiting"] == 'sum(pagoda:num_requests_waiting{namespace="team-a",service="tiny-pd-prefill"})'
    ttft = queries("ttft", "team-a", "tiny-pd", rate_window_s=60, role="prefill")["ttft_p90"]
    assert ttft == ('histogram_quantile(0.9, sum by (le) (rate(pagoda:time_to_first_token_seconds_bucket'
                    '{namespace="team-a",service="tiny-pd-prefill"}[60s])))')
    itl = queries("itl", "team-a", "tiny-pd", role="decode")["itl_p90"]
    assert 'pagoda:inter_token_latency_seconds_bucket{namespace="team-a",service="tiny-pd-decode"}' in itl
    # prometheusURL: the prefill block's, else spec.autoscaling's.
    body = _autoscaled_prefill(prometheusURL="http://prefill-prom:9090")
    body["spec"]["autoscaling"] = {"maxReplicas": 4, "prometheusURL": "http://prom:9090"}
    spec = parse_spec(body["spec"])
    assert prometheus_url(spec, prefill=True) == "http://prefill-prom:9090" and prometheus_url(spec) == "http://prom:9090"
    del body["spec"]["prefill"]["autoscaling"]["prometheusURL"]
    assert prometheus_url(parse_spec(body["spec"]), prefill=True) == "http://prom:9090"


def test_the_prefill_decision_reports_in_its_own_status_fields():
    import asyncio

    from pagoda_operator.autoscaler import handlers
    from pagoda_operator.autoscaler.decision import History

    body = _autoscaled_prefill(prometheusURL=None)
    del body["spec"]["prefill"]["autoscaling"]["prometheusURL"]
    body["status"] = {"roles": [{"name": "prefill", "replicas": 2, "readyReplicas": 1}]}
    outcome = asyncio.run(handlers.autoscale_once(body, History(), 1000.0, role=handlers.PREFILL))
    assert set(outcome.status) == {"prefillAutoscaling", "conditions"}
    (condition,) = outcome.status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == ("PrefillScalingReady", "False", "PrometheusUnavailable")
    assert "spec.prefill.autoscaling.prometheusURL" in condition["message"]
    decision = outcome.status["prefillAutoscaling"]["lastDecision"]
    assert (decision["result"], decision["inputs"]["currentReplicas"], decision["inputs"]["readyReplicas"]) == (1, 1, 1)
    assert outcome.pods == "prefill" and outcome.role.status_manager == "pagoda-autoscaler-prefill"
    # The decode pods' decision: none (no spec.autoscaling), the prefill one's status untouched.
    assert asyncio.run(handlers.autoscale_once(body, History(), 1000.0)) is None


# --- KEDA and HPA for each role ---------------------------------------------------------------

def _scaled_by(decode_driver: str, prefill_driver: str) -> dict:
    """The decode pods on spec.autoscaling (driver `decode_driver`, with the URL), the prefill
    pods on spec.prefill.autoscaling (`prefill_driver`, ttft, no URL of its own)."""
    body = _autoscaled_prefill(driver=prefill_driver, policy="ttft", target=0.5)
    del body["spec"]["prefill"]["autoscaling"]["prometheusURL"]
    body = with_spec(body, replicas=None, autoscaling={"driver": decode_driver, "maxReplicas": 4, "policy": "kvUtilization",
                                                       "target": 0.8, "prometheusURL": "http://prometheus:9090"})
    return body


def test_keda_and_hpa_scale_each_role_on_its_own_pods():
    from pagoda_operator.autoscaler.prometheus import queries
    from tests.operator import crd_schema

    objects = _rendered(_scaled_by("hpa", "keda"))
    hpa = objects[("HorizontalPodAutoscaler", "tiny-pd")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "name": "tiny-pd"}
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"] == {"namespace": "team-a",
                                                                                      "service": "tiny-pd-decode"}
    kubernetes_validate.validate(hpa, "1.33.0", strict=True)
    so = objects[("ScaledObject", "tiny-pd-prefill")]
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny-pd-prefill"}
    [trigger] = so["spec"]["triggers"]  # no router-held trigger: the prefill pods never scale from zero
    assert trigger["metadata"] == {"serverAddress": "http://prometheus:9090",  # spec.autoscaling's
                                   "query": queries("ttft", "team-a", "tiny-pd", role="prefill")["ttft_p90"], "threshold": "0.5"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 4)
    assert crd_schema.validate(so, "keda.scaledobjects.yaml").errors == []
    # The scaler owns the prefill Deployment's replicas: the operator's apply leaves them out.
    assert "replicas" not in objects[("Deployment", "tiny-pd-prefill")]["spec"]
    assert objects[("Deployment", "tiny-pd-decode")]["spec"]["replicas"] == 1  # spec.autoscaling's floor

    objects = _rendered(_scaled_by("keda", "hpa"))
    so = objects[("ScaledObject", "tiny-pd")]
    main, held = so["spec"]["triggers"]
    decode = queries("kvUtilization", "team-a", "tiny-pd", role="decode")
    assert (main["metadata"]["query"], held["metadata"]["query"]) == (decode["kv_usage"], decode["router_held"])
    assert crd_schema.validate(so, "keda.scaledobjects.yaml").errors == []
    hpa = objects[("HorizontalPodAutoscaler", "tiny-pd-prefill")]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment" and hpa["spec"]["scaleTargetRef"]["name"] == "tiny-pd-prefill"
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]["service"] == "tiny-pd-prefill"
    kubernetes_validate.validate(hpa, "1.33.0", strict=True)


def test_a_prefill_scaler_that_cannot_work_is_refused():
    body = _scaled_by("builtin", "keda")
    body["spec"]["prefill"]["replicas"] = 2
    assert any(p.startswith("prefill.replicas: set prefill.replicas or prefill.autoscaling, not both; with driver keda "
                            "the scaler sets the prefill Deployment's replicas") for p in _problems(body))
    body = _scaled_by("builtin", "keda")
    del body["spec"]["autoscaling"]
    body["spec"]["replicas"] = 2
    assert any(p.startswith("prefill.autoscaling.prometheusURL: required with driver keda") for p in _problems(body))
    # What an HPA would not read is refused, not ignored.
    body = _scaled_by("builtin", "hpa")
    body["spec"]["prefill"]["autoscaling"].update(prometheusURL="http://other:9090", intervalSeconds=5)
    problems = _problems(body)
    assert any(p.startswith("prefill.autoscaling.prometheusURL: an HPA reads its metrics through") for p in problems)
    assert any(p.startswith("prefill.autoscaling.intervalSeconds: an HPA has no interval") for p in problems)


def test_the_prefill_deployment_keeps_the_replicas_its_hpa_set(cluster):
    from tests.operator.test_operator_kmock import (DEPLOYMENTS, IS, NS, conditions, create, get, mark_rolled_out,
                                                    patch_spec, path_of, request, wait_for)

    apiserver, _ = cluster
    body = _scaled_by("builtin", "hpa")
    body["metadata"] = {"name": "pdh", "namespace": NS}
    create(apiserver, body)
    wait_for("the prefill HPA", lambda: get(apiserver, ("autoscaling", "v2", "horizontalpodautoscalers"), "pdh-prefill"))
    assert "replicas" not in get(apiserver, DEPLOYMENTS, "pdh-prefill")["spec"]
    # The HPA scales the Deployment to 3 (its scale subresource), the controller makes them ready.
    request(apiserver, "PATCH", path_of(DEPLOYMENTS, "pdh-prefill", "scale"), {"spec": {"replicas": 3}},
            "application/merge-patch+json", fieldManager="horizontal-pod-autoscaler")
    mark_rolled_out(apiserver, "pdh", 1)
    mark_rolled_out(apiserver, "pdh-decode", 1)
    mark_rolled_out(apiserver, "pdh-prefill", 2)
    says = "1/1 decode and 2/3 prefill replicas ready."
    wait_for(says, lambda: conditions(get(apiserver, IS, "pdh")).get("Ready", {}).get("message") == says)
    # A spec change re-applies the Deployment: the HPA's replicas stay.
    patch_spec(apiserver, "pdh", {"prefill": {"autoscaling": {"target": 0.7}}})
    wait_for("the change applied", lambda: get(apiserver, ("autoscaling", "v2", "horizontalpodautoscalers"), "pdh-prefill")
             ["spec"]["metrics"][0]["external"]["target"]["value"] == "0.7")
    assert get(apiserver, DEPLOYMENTS, "pdh-prefill")["spec"]["replicas"] == 3
    mark_rolled_out(apiserver, "pdh-prefill", 3)
    says = "1/1 decode and 3/3 prefill replicas ready."
    wait_for(says, lambda: conditions(get(apiserver, IS, "pdh")).get("Ready", {}).get("message") == says)
