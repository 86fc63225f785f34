"""The built-in autoscaler as a kopf timer: one decision per InferenceService with
`spec.autoscaling` (driver builtin) every `intervalSeconds`, and one for its prefill role with
`spec.prefill.autoscaling` every that block's `intervalSeconds`, each role with its own History.

Each decision: read the status (replicas, ready replicas), ask Prometheus (`prometheus.py`),
decide (`decision.py`), then, as the field manager `pagoda-autoscaler`,
  - set spec.replicas through the scale subresource, as HPA would; the operator's reconcile
    turns spec.replicas into the engine workload's replicas. The prefill role's count goes to
    spec.prefill.replicas (no scale subresource reaches it) by a JSON patch that first tests that
    spec.prefill.autoscaling is still what the decision was made from,
  - server-side apply its part of the status: `autoscaling` {desiredReplicas, lastDecision
    {time, inputs, result, recommendation, reason}} and the `ScalingReady` condition, which this
    module alone owns (the reconciler owns the other conditions: see `handlers.py`); the prefill
    role's `prefillAutoscaling` and `PrefillScalingReady` as `pagoda-autoscaler-prefill`, a
    manager of its own because each apply is whole (a field the manager applied before and leaves
    out now is removed) and the two roles decide at their own times,
  - post an Event when the replicas change or the condition flips (the prefill role's messages
    start with "prefill: ").
Prometheus unreachable or metrics missing: the condition False with the reason, replicas unchanged.

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


@dataclass(frozen=True)
class Role:
    """What differs between the decisions for the engine (or decode) pods and the prefill pods."""

    prefill: bool
    status_key: str  # the autoscaler's part of .status
    condition: str
    status_manager: str  # the field manager of that part
    memo_key: str  # where the timer keeps this role's History
    event_prefix: str


ENGINES = Role(False, "autoscaling", CONDITION, FIELD_MANAGER, "pagoda_autoscaler", "")
PREFILL = Role(True, "prefillAutoscaling", "PrefillScalingReady", "pagoda-autoscaler-prefill",
               "pagoda_autoscaler_prefill", "prefill: ")


def current_replicas(spec: dict, a: Autoscaling) -> int:
    """What the scaler last set: `spec`'s replicas (spec, or spec.prefill for the prefill role),
    else the floor the operator renders."""
    replicas = (spec or {}).get("replicas")
    return int(replicas) if isinstance(replicas, int) else a.min_replicas


def _prefill_ready(status: dict) -> int:
    return next((int(r.get("readyReplicas") or 0) for r in status.get("roles") or [] if r.get("name") == "prefill"), 0)


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
    flipped: bool  # the condition changed
    role: Role = ENGINES
    pods: str | None = None  # the pods decided for: None (one role), "decode" or "prefill" (spec.prefill)


async def autoscale_once(body: dict, history: History, now: float | None = None,
                         prometheus: PrometheusClient | None = None, role: Role = ENGINES) -> Outcome | None:
    """Decide for one InferenceService `body` (a dict as the API returns it), for its engine (or
    decode) pods, or with `role` PREFILL its prefill pods. None when that role has no built-in
    autoscaling or the spec does not parse (Validated=False says why)."""
    now = time.time() if now is None else now
    try:
        spec = parse_spec(body.get("spec"))
    except SpecProblems:
        return None
    if role.prefill:
        a = spec.prefill.autoscaling if spec.prefill is not None else None
    else:
        a = spec.autoscaling
    if a is None or a.driver != "builtin":
        return None
    status = body.get("status") or {}
    raw = body.get("spec") or {}
    if role.prefill:
        current, ready, pods = current_replicas(raw.get("prefill") or {}, a), _prefill_ready(status), "prefill"
    else:
        # spec.prefill: spec.replicas, and so this decision, are the decode pods'.
        current, ready = current_replicas(raw, a), int(status.get("readyReplicas") or 0)
        pods = "decode" if spec.prefill is not None else None
    settings = settings_of(a)
    url = prometheus_url(spec, prefill=role.prefill)
    meta = body.get("metadata") or {}
    if prometheus is None and url:
        prometheus = PrometheusClient(url)
    if prometheus is None:
        where = "spec.prefill.autoscaling.prometheusURL, spec.autoscaling.prometheusURL" if role.prefill \
            else "spec.autoscaling.prometheusURL"
        obs = Observation(current, ready, error=f"no Prometheus: set {where} (or {PROMETHEUS_URL_ENV} on the operator)")
    else:
        obs = await prometheus.observe(a.policy, meta.get("namespace") or "default", meta["name"], current, ready,
                                       rate_window_s=max(60, int(4 * interval_of(a))), role=pods)
    decision = decide(settings, obs, history, now)
    old = next((c for c in status.get("conditions") or [] if c.get("type") == role.condition), None)
    flipped = old is None or old.get("status") != ("True" if decision.scaling_ready else "False")
    last = {"time": _now_rfc3339(now, micro=True), "inputs": decision.inputs, "result": decision.replicas,
            "recommendation": decision.recommendation, "reason": decision.reason}
    conditions = set_condition([dict(c) for c in status.get("conditions") or []], role.condition,
                               decision.scaling_ready, decision.condition_reason, decision.reason,
                               int(meta.get("generation") or 0), _now_rfc3339(now))
    own = {
        role.status_key: {"desiredReplicas": decision.replicas,
                          "lastDecision": {k: v for k, v in last.items() if v is not None}},
        "conditions": [c for c in conditions if c["type"] == role.condition],
    }
    return Outcome(decision, current, ready, own, flipped, role, pods)


# ---- Kubernetes side effects ----------------------------------------------------------------

async def apply_outcome(client: AsyncClient, body: dict, outcome: Outcome, post_event=None) -> bool:
    """Scale (when the replicas change), apply the autoscaler's status, post an Event. False when
    nothing was applied: the prefill role's spec.prefill.autoscaling changed since `body` was
    read, so the decision is dropped and the next tick decides from the new spec."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    decision, role = outcome.decision, outcome.role
    if decision.changed(outcome.replicas_before):
        if role.prefill:
            given = ((body.get("spec") or {}).get("prefill") or {}).get("autoscaling")
            if not await kube.set_prefill_replicas(client, namespace, name, decision.replicas, given, FIELD_MANAGER):
                log.info("%s/%s: spec.prefill.autoscaling changed since the decision; not applied", namespace, name)
                return False
        else:
            await kube.scale(client, namespace, name, decision.replicas, FIELD_MANAGER)
        log.info("%s/%s: %s%d -> %d replicas: %s", namespace, name, role.event_prefix, outcome.replicas_before,
                 decision.replicas, decision.reason)
    await kube.apply_status(client, namespace, name, outcome.status, role.status_manager)
    metrics.record_decision(namespace, name, current=outcome.replicas_before, ready=outcome.ready_replicas,
                            desired=decision.replicas, scaling_ready=decision.scaling_ready, role=outcome.pods)
    if post_event and (decision.changed(outcome.replicas_before) or outcome.flipped):
        kind = "Normal" if decision.scaling_ready else "Warning"
        message = (f"{outcome.replicas_before} -> {decision.replicas} replicas: {decision.reason}"
                   if decision.changed(outcome.replicas_before) else decision.reason)
        post_event(body, type=kind, reason=decision.condition_reason, message=(role.event_prefix + message)[:1000])
    return True


def _blocks(spec) -> tuple[dict | None, dict | None]:
    """(spec.autoscaling, spec.prefill.autoscaling) as given, each only when the built-in
    autoscaler runs it."""
    spec = spec or {}
    a = spec.get("autoscaling")
    p = (spec.get("prefill") or {}).get("autoscaling")
    return ((a if a and a.get("driver", "builtin") == "builtin" else None),
            (p if p and p.get("driver", "builtin") == "builtin" else None))


def _builtin_autoscaled(spec, **_) -> bool:
    return any(_blocks(spec))


async def _autoscale_role(body: dict, memo, role: Role, block: dict, now: float) -> None:
    """One role's decision, if its interval has passed."""
    state = memo.get(role.memo_key)
    if state is None:
        state = memo[role.memo_key] = {"history": History(), "last": 0.0}
    try:
        interval = float(block.get("intervalSeconds") or DEFAULT_INTERVAL_S)
    except (TypeError, ValueError):
        interval = DEFAULT_INTERVAL_S
    if now - state["last"] < interval:
        return
    state["last"] = now
    body = dict(body)
    # Our last replicas write bumps metadata.generation; until the watch delivers it (late on a
    # loaded machine), `body` still holds the replicas from before it. Decide from what we set,
    # not from that: a stale count would repeat the write and its Event with the wrong "before".
    generation = (body.get("metadata") or {}).get("generation")
    scaled = state.get("scaled")
    if scaled is not None and scaled[0] == generation:
        spec = dict(body.get("spec") or {})
        if role.prefill:
            spec["prefill"] = {**(spec.get("prefill") or {}), "replicas": scaled[1]}
        else:
            spec["replicas"] = scaled[1]
        body["spec"] = spec
    outcome = await autoscale_once(body, state["history"], now, role=role)
    if outcome is not None:
        applied = await apply_outcome(memo.kube, body, outcome, post_event=kopf.event)
        if applied and outcome.decision.changed(outcome.replicas_before):
            state["scaled"] = (generation, outcome.decision.replicas)


async def autoscale(body, spec, memo, **_):
    """Every tick: for each role whose interval has passed, make one decision and apply it with
    the operator's API client (memo.kube)."""
    now = time.time()
    for role, block in zip((ENGINES, PREFILL), _blocks(spec)):
        if block is not None:
            await _autoscale_role(body, memo, role, block, now)


def _applied_status(meta: dict, manager: str) -> bool:
    """Does `manager` own status fields it applied (managedFields)?"""
    return any(e.get("manager") == manager and e.get("operation") == "Apply" and e.get("subresource") == "status"
               for e in meta.get("managedFields") or [])


async def forget(event: dict, body, spec, memo, **_) -> None:
    """A service deleted, or a role no longer on the built-in autoscaler: its decision series go,
    and so does its part of the status (an empty apply by its manager removes what that manager
    alone applied), so no stale decision or condition stays behind. Its spec.replicas or
    spec.prefill.replicas stay as last set, as an HPA's do when it is removed."""
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace") or "default", meta.get("name")
    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
        metrics.forget(namespace, name)
        return
    engines, prefill = _blocks(spec)
    disaggregated = bool((spec or {}).get("prefill"))
    kept = set()
    if engines:
        kept.add("decode" if disaggregated else None)
    if prefill:
        kept.add("prefill")
    metrics.forget(namespace, name, tuple(role for role in metrics.ROLES if role not in kept))
    for role, block in ((ENGINES, engines), (PREFILL, prefill)):
        if block is None and _applied_status(meta, role.status_manager):
            await kube.apply_status(memo.kube, namespace, name, {}, role.status_manager)
            memo.pop(role.memo_key, None)  # a block given again starts a fresh History


def register(registry: kopf.OperatorRegistry) -> None:
    """Attach the autoscaler's timer to a kopf registry (`handlers.register` does, for the operator)."""
    kopf.timer(GROUP, VERSION, PLURAL, registry=registry, id="autoscale", interval=TICK_S,
               when=_builtin_autoscaled)(autoscale)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="autoscaler-forget")(forget)
