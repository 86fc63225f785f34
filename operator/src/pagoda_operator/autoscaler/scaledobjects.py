"""Manifests for clusters that scale with KEDA or a HorizontalPodAutoscaler instead of the
built-in autoscaler (`spec.autoscaling.driver` or `spec.prefill.autoscaling.driver: keda | hpa`).
Pure: spec in, dicts out; the operator's renderer appends `render_scaler(body, spec)` to the
children it applies; both take the children's metadata from `children.py`.

spec.autoscaling's scaler targets the InferenceService's scale subresource (spec.replicas: the
engine pods, or with spec.prefill the decode pods), like the built-in one. spec.prefill.replicas
has no scale subresource, so spec.prefill.autoscaling's scaler targets the prefill Deployment
itself, whose replicas the operator then leaves to it (`scaled_directly`). Both read the same
PromQL as the built-in driver (`prometheus.queries`, of the role's own pods), so switching driver
does not change the arithmetic:
  - queue: total waiting requests against `target` per replica (AverageValue: ceil(total/target));
  - kvUtilization, ttft, itl: a per-service value against `target` (Value: ceil(replicas x value/target)).
KEDA adds, for the engine or decode pods, a second trigger on the router's held requests, which is
what activates 0 -> 1 (the prefill pods never scale to zero). HPA reads External metrics, so it
needs an adapter (prometheus-adapter) that serves them under EXTERNAL_METRIC_NAMES with the
`namespace` and `service` labels; HPA cannot scale to zero, so minReplicas 0 renders as 1 (an
annotation says so).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagoda_operator.autoscaler.decision import autoscaling_problems, interval_of, settings_of
from pagoda_operator.autoscaler.prometheus import queries, spec_prometheus_url
from pagoda_operator.children import child_metadata
from pagoda_operator.spec import API_VERSION, KIND, Autoscaling, InferenceServiceSpec

# policy -> (the PromQL field in prometheus.queries, how the target compares)
_POLICY_METRIC = {"queue": ("waiting", "AverageValue"), "kvUtilization": ("kv_usage", "Value"), "ttft": ("ttft_p90", "Value"),
                  "itl": ("itl_p90", "Value")}
EXTERNAL_METRIC_NAMES = {"queue": "pagoda_num_requests_waiting", "kvUtilization": "pagoda_kv_cache_usage_perc",
                         "ttft": "pagoda_time_to_first_token_seconds_p90",
                         "itl": "pagoda_inter_token_latency_seconds_p90"}
HPA_MIN_NOTE = "pagoda.dev/min-replicas-note"


def _autoscaling(spec: InferenceServiceSpec, role: str | None) -> Autoscaling:
    return spec.prefill.autoscaling if role == "prefill" else spec.autoscaling


def _behavior(a: Autoscaling) -> dict[str, Any]:
    s = settings_of(a)
    return {"scaleUp": {"stabilizationWindowSeconds": int(s.scale_up_delay_s)},
            "scaleDown": {"stabilizationWindowSeconds": int(s.scale_down_delay_s)}}


def _target_and_name(body: dict[str, Any], role: str | None) -> tuple[dict[str, str], str]:
    """(scaleTargetRef, the scaler object's name): the InferenceService, or the prefill Deployment."""
    name = body["metadata"]["name"]
    if role == "prefill":
        return {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{name}-prefill"}, f"{name}-prefill"
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name}, name


def render_keda_scaledobject(body: dict[str, Any], spec: InferenceServiceSpec, role: str | None = None) -> dict[str, Any]:
    """`role`: None (no spec.prefill), "decode" (spec.autoscaling with spec.prefill) or "prefill"."""
    a = _autoscaling(spec, role)
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    # spec.prefill.autoscaling's URL defaults to spec.autoscaling's, as for the built-in driver.
    url = spec_prometheus_url(spec, prefill=role == "prefill")
    problems = autoscaling_problems(replace(a, prometheus_url=url))
    if problems:
        raise ValueError("; ".join(problems))  # validation (autoscaling_problems) keeps this from happening
    promql = queries(a.policy, namespace, name, role=role)
    field, metric_type = _POLICY_METRIC[a.policy]
    target = settings_of(a).effective_target
    triggers = [
        {"type": "prometheus", "name": f"pagoda-{a.policy.lower()}", "metricType": metric_type,
         "metadata": {"serverAddress": url, "query": promql[field], "threshold": f"{target:g}"}},
    ]
    if "router_held" in promql:
        # Held requests at the router: the only signal while no engine exists (activation 0 -> 1).
        triggers.append({"type": "prometheus", "name": "pagoda-router-held", "metricType": "AverageValue",
                         "metadata": {"serverAddress": url, "query": promql["router_held"], "threshold": "1",
                                      "activationThreshold": "0"}})
    target_ref, object_name = _target_and_name(body, role)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(body, object_name, "autoscaler"),
        "spec": {
            "scaleTargetRef": target_ref,
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": int(interval_of(a)),
            "cooldownPeriod": int(settings_of(a).scale_down_delay_s),  # KEDA's delay before the last replica goes (scale to zero)
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(a)}},
            "triggers": triggers,
        },
    }


def render_hpa(body: dict[str, Any], spec: InferenceServiceSpec, role: str | None = None) -> dict[str, Any]:
    """`role`: as for `render_keda_scaledobject`."""
    a = _autoscaling(spec, role)
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    _, metric_type = _POLICY_METRIC[a.policy]
    target = settings_of(a).effective_target
    target_key = "averageValue" if metric_type == "AverageValue" else "value"
    target_ref, object_name = _target_and_name(body, role)
    hpa_meta = child_metadata(body, object_name, "autoscaler")
    if a.min_replicas == 0:
        hpa_meta["annotations"] = {HPA_MIN_NOTE: "minReplicas 0 rendered as 1: HPA cannot scale to zero; use driver keda or builtin"}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": hpa_meta,
        "spec": {
            "scaleTargetRef": target_ref,
            "minReplicas": max(1, a.min_replicas),
            "maxReplicas": a.max_replicas,
            "behavior": _behavior(a),
            "metrics": [{
                "type": "External",
                "external": {
                    "metric": {"name": EXTERNAL_METRIC_NAMES[a.policy],
                               "selector": {"matchLabels": {"namespace": namespace, "service": f"{name}-{role or 'engine'}"}}},
                    "target": {"type": metric_type, target_key: f"{target:g}"},
                },
            }],
        },
    }


def scaled_directly(spec: InferenceServiceSpec, role: str | None) -> bool:
    """Does a KEDA or HPA scaler set this role's workload replicas itself (the prefill pods under
    spec.prefill.autoscaling driver keda | hpa)? Then the operator leaves them out of what it applies."""
    return role == "prefill" and spec.prefill is not None and spec.prefill.autoscaling is not None \
        and spec.prefill.autoscaling.driver != "builtin"


def render_scaler(body: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The scaler objects the spec asks for, one per role on driver keda or hpa: [] for no
    autoscaling or the built-in driver."""
    out = []
    for role in ((None,) if spec.prefill is None else ("decode", "prefill")):
        a = _autoscaling(spec, role)
        if a is not None and a.driver != "builtin":
            out.append((render_keda_scaledobject if a.driver == "keda" else render_hpa)(body, spec, role))
    return out
