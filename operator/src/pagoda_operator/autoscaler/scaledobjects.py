"""Manifests for clusters that scale with KEDA or a HorizontalPodAutoscaler instead of the
built-in autoscaler (`spec.autoscaling.driver: keda | hpa`). Pure: spec in, dicts out; the
operator's renderer appends `render_scaler(body, spec)` to the children it applies; both take
the children's metadata from `children.py`.

Both target the InferenceService's scale subresource (spec.replicas), like the built-in one, and
read the same PromQL (`prometheus.queries`), so switching driver does not change the arithmetic:
  - queue: total waiting requests against `target` per replica (AverageValue: ceil(total/target));
  - kvUtilization, ttft, itl: a per-service value against `target` (Value: ceil(replicas x value/target)).
KEDA adds a second trigger on the router's held requests, which is what activates 0 -> 1.
HPA reads External metrics, so it needs an adapter (prometheus-adapter) that serves them under
EXTERNAL_METRIC_NAMES with the `namespace` and `service` labels; HPA cannot scale to zero, so
minReplicas 0 renders as 1 (an annotation says so).
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.autoscaler.decision import autoscaling_problems, interval_of, settings_of
from pagoda_operator.autoscaler.prometheus import queries
from pagoda_operator.children import child_metadata
from pagoda_operator.spec import API_VERSION, KIND, InferenceServiceSpec

# policy -> (the PromQL field in prometheus.queries, how the target compares)
_POLICY_METRIC = {"queue": ("waiting", "AverageValue"), "kvUtilization": ("kv_usage", "Value"), "ttft": ("ttft_p90", "Value"),
                  "itl": ("itl_p90", "Value")}
EXTERNAL_METRIC_NAMES = {"queue": "pagoda_num_requests_waiting", "kvUtilization": "pagoda_kv_cache_usage_perc",
                         "ttft": "pagoda_time_to_first_token_seconds_p90",
                         "itl": "pagoda_inter_token_latency_seconds_p90"}
HPA_MIN_NOTE = "pagoda.dev/min-replicas-note"


def _delays(spec: InferenceServiceSpec) -> tuple[int, int]:
    s = settings_of(spec.autoscaling)
    return int(s.scale_up_delay_s), int(s.scale_down_delay_s)


def _behavior(spec: InferenceServiceSpec) -> dict[str, Any]:
    up, down = _delays(spec)
    return {"scaleUp": {"stabilizationWindowSeconds": up}, "scaleDown": {"stabilizationWindowSeconds": down}}


def render_keda_scaledobject(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    a = spec.autoscaling
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    problems = autoscaling_problems(a)
    if problems:
        raise ValueError("; ".join(problems))  # validation (autoscaling_problems) keeps this from happening
    promql = queries(a.policy, namespace, name)
    field, metric_type = _POLICY_METRIC[a.policy]
    target = settings_of(a).effective_target
    triggers = [
        {"type": "prometheus", "name": f"pagoda-{a.policy.lower()}", "metricType": metric_type,
         "metadata": {"serverAddress": a.prometheus_url, "query": promql[field], "threshold": f"{target:g}"}},
        # Held requests at the router: the only signal while no engine exists (activation 0 -> 1).
        {"type": "prometheus", "name": "pagoda-router-held", "metricType": "AverageValue",
         "metadata": {"serverAddress": a.prometheus_url, "query": promql["router_held"], "threshold": "1",
                      "activationThreshold": "0"}},
    ]
    _, down = _delays(spec)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(body, name, "autoscaler"),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": int(interval_of(a)),
            "cooldownPeriod": down,  # KEDA's delay before the last replica goes (scale to zero)
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": triggers,
        },
    }


def render_hpa(body: dict[str, Any], spec: InferenceServiceSpec) -> dict[str, Any]:
    a = spec.autoscaling
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    _, metric_type = _POLICY_METRIC[a.policy]
    target = settings_of(a).effective_target
    target_key = "averageValue" if metric_type == "AverageValue" else "value"
    hpa_meta = child_metadata(body, name, "autoscaler")
    if a.min_replicas == 0:
        hpa_meta["annotations"] = {HPA_MIN_NOTE: "minReplicas 0 rendered as 1: HPA cannot scale to zero; use driver keda or builtin"}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": hpa_meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicas": max(1, a.min_replicas),
            "maxReplicas": a.max_replicas,
            "behavior": _behavior(spec),
            "metrics": [{
                "type": "External",
                "external": {
                    "metric": {"name": EXTERNAL_METRIC_NAMES[a.policy],
                               "selector": {"matchLabels": {"namespace": namespace, "service": f"{name}-engine"}}},
                    "target": {"type": metric_type, target_key: f"{target:g}"},
                },
            }],
        },
    }


def render_scaler(body: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The scaler object the spec asks for: [] for no autoscaling or the built-in driver."""
    a = spec.autoscaling
    if a is None or a.driver == "builtin":
        return []
    return [render_keda_scaledobject(body, spec) if a.driver == "keda" else render_hpa(body, spec)]
