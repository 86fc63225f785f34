"""The built-in autoscaler as a kopf timer: one decision per InferenceService with
`spec.autoscaling` (driver builtin) every `intervalSeconds`.

Each decision: read the status (replicas, ready replicas), ask Prometheus (`prometheus.py`),
decide (`decision.py`), then
  - set spec.replicas through the scale subresource (field manager `pagoda-autoscaler`), as HPA
    would; the operator's reconcile turns spec.replicas into the engine workload's replicas,
  - write `status.autoscaling` {desiredReplicas, lastDecision {time, inputs, result,
    recommendation, reason}} and the `ScalingReady` condition (this module owns that condition;
    the operator keeps it),
  - post an Event when the replicas change or ScalingReady flips.
Prometheus unreachable or metrics missing: ScalingReady=False with the reason, replicas unchanged.

`autoscale_once()` is the whole decision step without kopf, for tests and for anyone who wants
to run the autoscaler outside the operator.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import kopf

from pagoda_operator.autoscaler.decision import (DEFAULT_INTERVAL_S, Decision, History, Observation, decide,
                                                interval_of, settings_of)
from pagoda_operator.autoscaler.prometheus import PrometheusClient
from pagoda_operator.conditions import set_condition
from pagoda_operator.schema import SpecProblems
from pagoda_operator.spec import GROUP, PLURAL, VERSION, Autoscaling, parse_spec

log = logging.getLogger("pagoda.autoscaler")

FIELD_MANAGER = "pagoda-autoscaler"  # starts with "pagoda": validation accepts it as spec.replicas' owner
CONDITION = "ScalingReady"
TICK_S = 1.0  # the kopf timer's period; decisions are spaced by each service's intervalSeconds
PROMETHEUS_URL_ENV = "PAGODA_PROMETHEUS_URL"  # operator-wide default for spec.autoscaling.prometheusURL


def current_replicas(spec: dict, a: Autoscaling) -> int:
    """What the scaler last set: spec.replicas, else the floor the operator renders."""
    replicas = (spec or {}).get("replicas")
    return int(replicas) if isinstance(replicas, int) else a.min_replicas


def _now_rfc3339(now: float, micro: bool = False) -> str:
    """RFC 3339 in UTC. Conditions take whole seconds (metav1.Time); a decision's time keeps
    microseconds (as metav1.MicroTime does), so the spacing of decisions a few seconds apart, and
    so the delay windows, can be read back from the status exactly."""
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ"
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime(fmt)


@dataclass
class Outcome:
    decision: Decision
    replicas_before: int
    status_patch: dict  # merge into .status
    flipped: bool  # ScalingReady changed


async def autoscale_once(body: dict, history: History, now: float | None = None,
                         prometheus: PrometheusClient | None = None) -> Outcome | None:
    """Decide for one InferenceService `body` (a dict as the API returns it). None when it has no
    built-in autoscaling or its spec does not parse (Validated=False says why)."""
    now = time.time() if now is None else now
    try:
        spec = parse_spec(body.get("spec"))
    except SpecProblems:
        return None
    a = spec.autoscaling
    if a is None or a.driver != "builtin":
        return None
    status = body.get("status") or {}
    current = current_replicas(body.get("spec") or {}, a)
    ready = int(status.get("readyReplicas") or 0)
    settings = settings_of(a)
    url = a.prometheus_url or os.environ.get(PROMETHEUS_URL_ENV)
    meta = body.get("metadata") or {}
    if prometheus is None and url:
        prometheus = PrometheusClient(url)
    if prometheus is None:
        obs = Observation(current, ready, error=f"no Prometheus: set spec.autoscaling.prometheusURL "
                                                f"(or {PROMETHEUS_URL_ENV} on the operator)")
    else:
        obs = await prometheus.observe(a.policy, meta.get("namespace") or "default", meta["name"], current, ready,
                                       rate_window_s=max(60, int(4 * interval_of(a))))
    decision = decide(settings, obs, history, now)
    old = next((c for c in status.get("conditions") or [] if c.get("type") == CONDITION), None)
    flipped = old is None or old.get("status") != ("True" if decision.scaling_ready else "False")
    patch = {
        "autoscaling": {
            "desiredReplicas": decision.replicas,
            "lastDecision": {"time": _now_rfc3339(now, micro=True), "inputs": decision.inputs,
                             "result": decision.replicas, "recommendation": decision.recommendation,
                             "reason": decision.reason},
        },
        "conditions": set_condition([dict(c) for c in status.get("conditions") or []], CONDITION,
                                    decision.scaling_ready, decision.condition_reason, decision.reason,
                                    int(meta.get("generation") or 0), _now_rfc3339(now)),
    }
    return Outcome(decision, current, patch, flipped)


# ---- Kubernetes side effects ----------------------------------------------------------------

def _custom_objects_api():
    """The kubernetes client, configured in-cluster or from the kubeconfig (KUBECONFIG). Built per
    call: scaling is rare, and a cached client would outlive a changed kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # KUBECONFIG is read now: the client's default path is fixed when it is imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    return client.CustomObjectsApi()


def set_replicas(namespace: str, name: str, replicas: int) -> None:
    """spec.replicas through the scale subresource, the way HPA and KEDA write it."""
    _custom_objects_api().patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}},
        field_manager=FIELD_MANAGER, _content_type="application/merge-patch+json")


async def apply_outcome(body: dict, outcome: Outcome, patch: Any, post_event=None) -> None:
    """Scale (when the replicas change), write status into kopf's `patch`, post an Event."""
    meta = body["metadata"]
    decision = outcome.decision
    if decision.changed(outcome.replicas_before):
        await asyncio.to_thread(set_replicas, meta.get("namespace") or "default", meta["name"], decision.replicas)
        log.info("%s/%s: %d -> %d replicas: %s", meta.get("namespace"), meta["name"], outcome.replicas_before,
                 decision.replicas, decision.reason)
    for key, value in outcome.status_patch.items():
        patch.status[key] = value
    if post_event and (decision.changed(outcome.replicas_before) or outcome.flipped):
        kind = "Normal" if decision.scaling_ready else "Warning"
        message = (f"{outcome.replicas_before} -> {decision.replicas} replicas: {decision.reason}"
                   if decision.changed(outcome.replicas_before) else decision.reason)
        post_event(body, type=kind, reason=decision.condition_reason, message=message[:1000])


def _builtin_autoscaled(spec, **_) -> bool:
    a = (spec or {}).get("autoscaling")
    return bool(a) and a.get("driver", "builtin") == "builtin"


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_S, when=_builtin_autoscaled)
async def autoscale(body, spec, memo, patch, **_):
    """Every tick: if this service's interval has passed, make one decision and apply it."""
    state = memo.get("pagoda_autoscaler")
    if state is None:
        state = memo["pagoda_autoscaler"] = {"history": History(), "last": 0.0}
    try:
        interval = float((spec.get("autoscaling") or {}).get("intervalSeconds") or DEFAULT_INTERVAL_S)
    except (TypeError, ValueError):
        interval = DEFAULT_INTERVAL_S
    now = time.time()
    if now - state["last"] < interval:
        return
    state["last"] = now
    body = dict(body)
    # Our last scale write bumps metadata.generation; until the watch delivers it (late on a
    # loaded machine), `body` still holds the replicas from before it. Decide from what we set,
    # not from that: a stale count would repeat the write and its Event with the wrong "before".
    generation = (body.get("metadata") or {}).get("generation")
    scaled = state.get("scaled")
    if scaled is not None and scaled[0] == generation:
        body["spec"] = {**(body.get("spec") or {}), "replicas": scaled[1]}
    outcome = await autoscale_once(body, state["history"], now)
    if outcome is not None:
        await apply_outcome(body, outcome, patch, post_event=kopf.event)
        if outcome.decision.changed(outcome.replicas_before):
            state["scaled"] = (generation, outcome.decision.replicas)
