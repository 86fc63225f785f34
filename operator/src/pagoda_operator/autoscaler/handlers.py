"""The built-in autoscaler as a kopf timer: one decision per InferenceService with
`spec.autoscaling` (driver builtin) every `intervalSeconds`.

Each decision: read the status (replicas, ready replicas), ask Prometheus (`prometheus.py`),
decide (`decision.py`), then, as the field manager `pagoda-autoscaler`,
  - set spec.replicas through the scale subresource, as HPA would; the operator's reconcile
    turns spec.replicas into the engine workload's replicas,
  - server-side apply its part of the status: `autoscaling` {desiredReplicas, lastDecision
    {time, inputs, result, recommendation, reason}} and the `ScalingReady` condition, which this
    module alone owns (the reconciler owns the other conditions: see `handlers.py`),
  - post an Event when the replicas change or ScalingReady flips.
Prometheus unreachable or metrics missing: ScalingReady=False with the reason, replicas unchanged.

`autoscale_once()` is the whole decision step without kopf, for tests and for anyone who wants
to run the autoscaler outside the operator.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import kopf
from lightkube import AsyncClient

from pagoda_operator import kube, metrics
from pagoda_operator.autoscaler.decision import (DEFAULT_INTERVAL_S, Decision, History, Observation, decide,
                                                interval_of, settings_of)
from pagoda_operator.autoscaler.prometheus import PROMETHEUS_URL_ENV, PrometheusClient, prometheus_url
from pagoda_operator.conditions import set_condition
from pagoda_operator.schema import SpecProblems
from pagoda_operator.spec import GROUP, PLURAL, VERSION, Autoscaling, parse_spec

log = logging.getLogger("pagoda.autoscaler")

FIELD_MANAGER = "pagoda-autoscaler"  # starts with "pagoda": validation accepts it as spec.replicas' owner
CONDITION = "ScalingReady"
TICK_S = 1.0  # the kopf timer's period; decisions are spaced by each service's intervalSeconds


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
    ready_replicas: int  # engine replicas ready when it decided
    status: dict  # the autoscaler's part of .status, applied whole
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
    url = prometheus_url(spec)
    meta = body.get("metadata") or {}
    if prometheus is None and url:
        prometheus = PrometheusClient(url)
    if prometheus is None:
        obs = Observation(current, ready, error=f"no Prometheus: set spec.autoscaling.prometheusURL "
                                                f"(or {PROMETHEUS_URL_ENV} on the operator)")
    else:
        # spec.prefill: spec.replicas, and so this autoscaler, are the decode pods'.
        obs = await prometheus.observe(a.policy, meta.get("namespace") or "default", meta["name"], current, ready,
                                       rate_window_s=max(60, int(4 * interval_of(a))),
                                       role="decode" if spec.prefill is not None else None)
    decision = decide(settings, obs, history, now)
    old = next((c for c in status.get("conditions") or [] if c.get("type") == CONDITION), None)
    flipped = old is None or old.get("status") != ("True" if decision.scaling_ready else "False")
    last = {"time": _now_rfc3339(now, micro=True), "inputs": decision.inputs, "result": decision.replicas,
            "recommendation": decision.recommendation, "reason": decision.reason}
    conditions = set_condition([dict(c) for c in status.get("conditions") or []], CONDITION, decision.scaling_ready,
                               decision.condition_reason, decision.reason, int(meta.get("generation") or 0),
                               _now_rfc3339(now))
    own = {
        "autoscaling": {"desiredReplicas": decision.replicas,
                        "lastDecision": {k: v for k, v in last.items() if v is not None}},
        "conditions": [c for c in conditions if c["type"] == CONDITION],
    }
    return Outcome(decision, current, ready, own, flipped)


# ---- Kubernetes side effects ----------------------------------------------------------------

async def apply_outcome(client: AsyncClient, body: dict, outcome: Outcome, post_event=None) -> None:
    """Scale (when the replicas change), apply the autoscaler's status, post an Event."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    decision = outcome.decision
    if decision.changed(outcome.replicas_before):
        await kube.scale(client, namespace, name, decision.replicas, FIELD_MANAGER)
        log.info("%s/%s: %d -> %d replicas: %s", namespace, name, outcome.replicas_before, decision.replicas,
                 decision.reason)
    await kube.apply_status(client, namespace, name, outcome.status, FIELD_MANAGER)
    metrics.record_decision(namespace, name, current=outcome.replicas_before, ready=outcome.ready_replicas,
                            desired=decision.replicas, scaling_ready=decision.scaling_ready)
    if post_event and (decision.changed(outcome.replicas_before) or outcome.flipped):
        kind = "Normal" if decision.scaling_ready else "Warning"
        message = (f"{outcome.replicas_before} -> {decision.replicas} replicas: {decision.reason}"
                   if decision.changed(outcome.replicas_before) else decision.reason)
        post_event(body, type=kind, reason=decision.condition_reason, message=message[:1000])


def _builtin_autoscaled(spec, **_) -> bool:
    a = (spec or {}).get("autoscaling")
    return bool(a) and a.get("driver", "builtin") == "builtin"


async def autoscale(body, spec, memo, **_):
    """Every tick: if this service's interval has passed, make one decision and apply it with
    the operator's API client (memo.kube)."""
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
        await apply_outcome(memo.kube, body, outcome, post_event=kopf.event)
        if outcome.decision.changed(outcome.replicas_before):
            state["scaled"] = (generation, outcome.decision.replicas)


async def forget_metrics(event: dict, body, spec, **_) -> None:
    """A service deleted, or no longer on the built-in autoscaler: its decision series go."""
    deleting = event.get("type") == "DELETED" or (body.get("metadata") or {}).get("deletionTimestamp")
    if deleting or not _builtin_autoscaled(spec):
        meta = body.get("metadata") or {}
        metrics.forget(meta.get("namespace") or "default", meta.get("name"))


def register(registry: kopf.OperatorRegistry) -> None:
    """Attach the autoscaler's timer to a kopf registry (`handlers.register` does, for the operator)."""
    kopf.timer(GROUP, VERSION, PLURAL, registry=registry, id="autoscale", interval=TICK_S,
               when=_builtin_autoscaled)(autoscale)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="autoscaler-metrics")(forget_metrics)
