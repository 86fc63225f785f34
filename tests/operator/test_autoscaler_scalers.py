"""driver keda | hpa: the ScaledObject / HPA manifests the operator applies instead of running
the built-in autoscaler. Same PromQL and arithmetic as the built-in driver."""

import kubernetes_validate
import pytest

from pagoda_operator.autoscaler.decision import autoscaling_problems
from pagoda_operator.autoscaler.prometheus import queries
from pagoda_operator.autoscaler.scaledobjects import HPA_MIN_NOTE, render_scaler
from pagoda_operator.spec import parse_spec
from tests.operator import crd_schema

PROM = "http://prometheus.monitoring.svc:9090"


def validate_scaledobject(so: dict) -> None:
    """Against the real KEDA ScaledObject CRD (schema, CEL rules, strict fields)."""
    assert crd_schema.validate(so, "keda.scaledobjects.yaml").errors == []


def body(autoscaling: dict) -> dict:
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "prod", "uid": "1234"},
            "spec": {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "autoscaling": autoscaling}}


def render(autoscaling: dict) -> list[dict]:
    b = body(autoscaling)
    return render_scaler(b, parse_spec(b["spec"]))


def test_builtin_driver_and_no_autoscaling_render_nothing():
    assert render({"maxReplicas": 3}) == []
    b = body({"maxReplicas": 3})
    del b["spec"]["autoscaling"]
    assert render_scaler(b, parse_spec(b["spec"])) == []


def test_keda_queue_scaledobject_targets_the_scale_subresource_with_the_builtin_promql():
    [so] = render({"driver": "keda", "minReplicas": 0, "maxReplicas": 6, "policy": "queue", "target": 4,
                   "prometheusURL": PROM, "scaleUpDelay": "30s", "scaleDownDelay": "10m", "intervalSeconds": 20})
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    assert so["metadata"]["name"] == "llama" and so["metadata"]["namespace"] == "prod"
    assert so["metadata"]["ownerReferences"][0]["uid"] == "1234"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "name": "llama"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"], spec["cooldownPeriod"]) == (0, 6, 20, 600)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 30}, "scaleDown": {"stabilizationWindowSeconds": 600}}
    main, held = spec["triggers"]
    q = queries("queue", "prod", "llama")
    assert main["metadata"] == {"serverAddress": PROM, "query": q["waiting"], "threshold": "4"}
    assert main["metricType"] == "AverageValue"  # ceil(total waiting / target), as the built-in driver
    assert held["metadata"]["query"] == q["router_held"] and held["metadata"]["activationThreshold"] == "0"
    validate_scaledobject(so)
    # The CRD bites: a trigger without its type is refused.
    bad = {**so, "spec": {**spec, "triggers": [{k: v for k, v in main.items() if k != "type"}]}}
    assert crd_schema.validate(bad, "keda.scaledobjects.yaml").errors


def test_keda_needs_a_prometheus_url():
    with pytest.raises(ValueError, match="prometheusURL: required with driver keda"):
        render({"driver": "keda", "maxReplicas": 2})


@pytest.mark.parametrize("autoscaling, problem", [
    ({"driver": "keda", "maxReplicas": 2}, "autoscaling.prometheusURL: required with driver keda"),
    ({"maxReplicas": 2, "policy": "kvUtilization", "target": 70}, "can never be reached"),
    ({"maxReplicas": 2, "policy": "kvUtilization", "target": 0.7}, None),
    ({"maxReplicas": 2, "driver": "hpa"}, None),
    ({"maxReplicas": 2, "driver": "hpa", "intervalSeconds": 10}, "autoscaling.intervalSeconds: an HPA has no interval"),
])
def test_autoscaling_problems_for_validation(autoscaling, problem):
    problems = autoscaling_problems(parse_spec(body(autoscaling)["spec"]).autoscaling)
    assert problems == [] if problem is None else (len(problems) == 1 and problem in problems[0])


def test_hpa_kv_utilization_uses_value_targets_and_validates():
    [hpa] = render({"driver": "hpa", "minReplicas": 1, "maxReplicas": 5, "policy": "kvUtilization", "target": 0.8})
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"] == {"name": "pagoda_kv_cache_usage_perc",
                                "selector": {"matchLabels": {"namespace": "prod", "service": "llama-engine"}}}
    assert metric["target"] == {"type": "Value", "value": "0.8"}
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300  # the default delay
    kubernetes_validate.validate(hpa, "1.33", strict=True)


def test_hpa_cannot_scale_to_zero_and_says_so():
    [hpa] = render({"driver": "hpa", "minReplicas": 0, "maxReplicas": 2})
    assert hpa["spec"]["minReplicas"] == 1
    assert "cannot scale to zero" in hpa["metadata"]["annotations"][HPA_MIN_NOTE]
    assert hpa["spec"]["metrics"][0]["external"]["target"] == {"type": "AverageValue", "averageValue": "2"}
    kubernetes_validate.validate(hpa, "1.33", strict=True)


def test_itl_scales_on_the_engines_inter_token_latency_with_value_targets():
    [so] = render({"driver": "keda", "maxReplicas": 4, "policy": "itl", "prometheusURL": PROM, "intervalSeconds": 30})
    main = so["spec"]["triggers"][0]
    assert main["metricType"] == "Value" and main["metadata"]["threshold"] == "0.05"  # the default target: 50 ms
    assert main["metadata"]["query"] == queries("itl", "prod", "llama")["itl_p90"]
    assert "pagoda:inter_token_latency_seconds_bucket" in main["metadata"]["query"]
    validate_scaledobject(so)
    [hpa] = render({"driver": "hpa", "maxReplicas": 4, "policy": "itl", "target": 0.03})
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"]["name"] == "pagoda_inter_token_latency_seconds_p90"
    assert metric["target"] == {"type": "Value", "value": "0.03"}
    kubernetes_validate.validate(hpa, "1.33.0", strict=True)


def test_validation_reports_the_autoscaling_problems():
    from pagoda_operator.validation import check

    checked = check(body({"driver": "keda", "maxReplicas": 2, "policy": "kvUtilization", "target": 70}))
    assert any(p.startswith("autoscaling.prometheusURL: required with driver keda") for p in checked.problems)
    assert any(p.startswith("autoscaling.target: 70 can never be reached") for p in checked.problems)
