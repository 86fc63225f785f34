"""The autoscaling decision: a pure function from (settings, observed metrics, recent history,
now) to the replica count, the reason, and whether scaling can be trusted at all.

No I/O and no clock: `handlers.py` gathers the inputs (Prometheus, the resource's status) and
applies the result; the tests drive this directly, table by table.

The rules, in order:
1. Prometheus unreachable or a needed metric missing -> no change, ScalingReady=False.
2. At zero replicas: requests held by the router (or queued anywhere) -> max(1, min) at once,
   without waiting for scaleUpDelay (someone is waiting now); otherwise stay at min.
3. Otherwise the policy asks for a count:
   - queue: waiting requests (engines + router's held ones) per ready replica against `target`:
     above it -> ceil(waiting / target); zero waiting -> one replica fewer (a queue that is empty
     says there are enough replicas, not how many, so it steps down gently); else unchanged.
   - kvUtilization / ttft / itl: proportional, ceil(ready * value / target), as Kubernetes' HPA
     does, with a 10 % tolerance band around the target.
   The prefill role of a disaggregated service (spec.prefill.autoscaling) is decided by the same
   rules from its own pods' metrics and its own History; it has no router_held (the router sends
   a request that finds no prefill pod to the decode pods whole, so it holds none for them).
4. Bounds [min, max]. Zero only when min is 0, nothing runs, waits or is held, and no replica is
   still starting (ready < current): a starting replica may be about to serve held requests.
5. Delays, as HPA's stabilization windows: scale up to the smallest count asked for during the
   last scaleUpDelay, down to the largest count asked for during the last scaleDownDelay. Until
   the history covers a window, the current count stands in for the missing part, so a restart
   of the operator never causes an immediate scale-down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda_operator.schema import parse_duration

if TYPE_CHECKING:
    from pagoda_operator.spec import Autoscaling

POLICIES = ("queue", "kvUtilization", "ttft", "itl")
# waiting/replica, fraction, seconds, seconds (itl: the 50 ms of a smooth stream)
DEFAULT_TARGETS = {"queue": 2.0, "kvUtilization": 0.7, "ttft": 1.0, "itl": 0.05}
# What the prefill role may scale on, and why not on the others (a sentence for Validated).
PREFILL_POLICIES = ("queue", "ttft")
NOT_FOR_PREFILL = {
    "kvUtilization": "a prefill pod's KV pages in use are the prompts it holds until a decode pod pulls them: "
                     "they measure how fast the decode pods pull, not how busy the prefill pods are",
    "itl": "a prefill pod makes one token per request, so it has no inter-token latency",
}
TOLERANCE = 0.1
# spec.autoscaling fields left unset (shared by the built-in driver and the KEDA/HPA manifests)
DEFAULT_INTERVAL_S = 15
DEFAULT_SCALE_UP_DELAY_S = 0.0
DEFAULT_SCALE_DOWN_DELAY_S = 300.0


@dataclass(frozen=True)
class Settings:
    min_replicas: int
    max_replicas: int
    policy: str = "queue"
    target: float | None = None  # None: DEFAULT_TARGETS[policy]
    scale_up_delay_s: float = 0.0
    scale_down_delay_s: float = 300.0

    @property
    def effective_target(self) -> float:
        return self.target if self.target is not None else DEFAULT_TARGETS[self.policy]


def settings_of(a: "Autoscaling") -> Settings:
    """Settings from spec.autoscaling, defaults filled in."""
    return Settings(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        policy=a.policy,
        target=a.target,
        scale_up_delay_s=parse_duration(a.scale_up_delay) if a.scale_up_delay else DEFAULT_SCALE_UP_DELAY_S,
        scale_down_delay_s=parse_duration(a.scale_down_delay) if a.scale_down_delay else DEFAULT_SCALE_DOWN_DELAY_S,
    )


def autoscaling_problems(a: "Autoscaling", where: str = "autoscaling") -> list[str]:
    """What in an autoscaling block (`where`: spec.autoscaling, or prefill.autoscaling) cannot
    work, as sentences for the Validated condition (the operator's validation calls this)."""
    problems = []
    if a.driver == "keda" and not a.prometheus_url:
        problems.append(f"{where}.prometheusURL: required with driver keda (the ScaledObject's trigger "
                        "queries it)")
    if a.driver == "hpa" and a.interval_seconds is not None:
        problems.append(f"{where}.intervalSeconds: an HPA has no interval of its own (the controller manager's "
                        "--horizontal-pod-autoscaler-sync-period paces every HPA); remove it, or use driver keda "
                        "or builtin")
    if a.policy == "kvUtilization" and a.target is not None and a.target > 1:
        problems.append(f"{where}.target: {a.target:g} can never be reached: kvUtilization is the "
                        "fraction of the KV cache in use, in (0, 1]")
    for name, value in (("scaleUpDelay", a.scale_up_delay), ("scaleDownDelay", a.scale_down_delay)):
        if value:
            try:
                parse_duration(value)
            except ValueError as e:
                problems.append(f"{where}.{name}: {e}")
    return problems


def interval_of(a: "Autoscaling") -> float:
    return float(a.interval_seconds or DEFAULT_INTERVAL_S)


@dataclass(frozen=True)
class Observation:
    """What was measured. `None` means the series was absent from Prometheus."""

    current_replicas: int  # what the scaler last set (spec.replicas)
    ready_replicas: int  # engine replicas passing readiness
    waiting: float | None = None  # sum of pagoda:num_requests_waiting over the replicas
    running: float | None = None  # sum of pagoda:num_requests_running
    kv_usage: float | None = None  # mean pagoda:kv_cache_usage_perc
    ttft_p90: float | None = None  # seconds; NaN-free (no traffic reads as 0)
    itl_p90: float | None = None  # seconds, as ttft_p90
    router_held: float | None = None  # pagoda_router:queue_length, summed over router pods
    error: str | None = None  # Prometheus could not be asked


@dataclass
class History:
    """Recommendations of recent decisions, for the delay windows. Kept per resource by the
    caller between decisions; `since` is when this history started."""

    since: float | None = None
    recommendations: list[tuple[float, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Decision:
    replicas: int  # what to set (equal to current: no change)
    reason: str  # a sentence for status.lastDecision.reason and the Event
    scaling_ready: bool  # the ScalingReady condition
    condition_reason: str  # CamelCase reason for the condition / Event
    inputs: dict
    recommendation: int | None = None  # what the policy asked for before the delays

    def changed(self, current: int) -> bool:
        return self.replicas != current


def _metric_of(settings: Settings, obs: Observation) -> tuple[str, float | None]:
    if settings.policy == "queue":
        if obs.waiting is None:
            return "pagoda:num_requests_waiting", None
        return "waiting", obs.waiting + (obs.router_held or 0.0)
    if settings.policy == "kvUtilization":
        return "pagoda:kv_cache_usage_perc", obs.kv_usage
    if settings.policy == "ttft":
        return "pagoda:time_to_first_token_seconds", obs.ttft_p90
    if settings.policy == "itl":
        return "pagoda:inter_token_latency_seconds", obs.itl_p90
    raise ValueError(f"unknown autoscaling policy {settings.policy!r}; choose one of {', '.join(POLICIES)}")


def _inputs(settings: Settings, obs: Observation) -> dict:
    out = {"policy": settings.policy, "target": settings.effective_target,
           "currentReplicas": obs.current_replicas, "readyReplicas": obs.ready_replicas}
    for key, value in (("waiting", obs.waiting), ("running", obs.running), ("kvUsage", obs.kv_usage),
                       ("ttftP90Seconds", obs.ttft_p90), ("itlP90Seconds", obs.itl_p90), ("routerHeld", obs.router_held)):
        if value is not None:
            out[key] = round(float(value), 6)
    return out


def _recommend(settings: Settings, obs: Observation, value: float) -> tuple[int, str]:
    """What the policy alone asks for, with the arithmetic as the reason."""
    target = settings.effective_target
    current = obs.current_replicas
    ready = max(obs.ready_replicas, 1)
    if settings.policy == "queue":
        per_replica = value / ready
        if per_replica > target:
            want = math.ceil(value / target)
            return want, f"{value:g} waiting = {per_replica:.2f}/replica > target {target:g} -> ceil({value:g}/{target:g}) = {want}"
        if value == 0:
            return current - 1, f"no request waiting -> one replica fewer ({current - 1})"
        return current, f"{value:g} waiting = {per_replica:.2f}/replica <= target {target:g} -> keep {current}"
    ratio = value / target
    unit = "s" if settings.policy in ("ttft", "itl") else ""
    if abs(ratio - 1.0) <= TOLERANCE:
        return current, f"{settings.policy} {value:.3g}{unit} within {TOLERANCE:.0%} of target {target:g}{unit} -> keep {current}"
    want = math.ceil(ready * ratio)
    return want, f"{settings.policy} {value:.3g}{unit} vs target {target:g}{unit} -> ceil({ready} x {ratio:.3f}) = {want}"


def _idle(obs: Observation) -> bool:
    return not (obs.waiting or obs.running or obs.router_held)


def _stabilize(history: History, settings: Settings, current: int, now: float) -> tuple[int, str]:
    """Apply the delay windows to the recommendations in `history` (which includes now's)."""

    def window(delay: float) -> list[int]:
        recs = [r for t, r in history.recommendations if t >= now - delay]
        if history.since is None or history.since > now - delay:
            recs.append(current)  # the history does not cover the window yet
        return recs

    up = min(window(settings.scale_up_delay_s))
    down = max(window(settings.scale_down_delay_s))
    if up > current:
        return up, f"asked for >= {up} throughout scaleUpDelay {settings.scale_up_delay_s:g}s"
    if down < current:
        return down, f"asked for <= {down} throughout scaleDownDelay {settings.scale_down_delay_s:g}s"
    if history.recommendations and history.recommendations[-1][1] != current:
        wanted = history.recommendations[-1][1]
        delay = settings.scale_up_delay_s if wanted > current else settings.scale_down_delay_s
        return current, f"waiting for {'scaleUpDelay' if wanted > current else 'scaleDownDelay'} {delay:g}s before {wanted}"
    return current, "steady"


def decide(settings: Settings, obs: Observation, history: History, now: float) -> Decision:
    """One decision. Appends this decision's recommendation to `history` (and prunes it)."""
    if settings.min_replicas > settings.max_replicas:
        raise ValueError(f"minReplicas {settings.min_replicas} > maxReplicas {settings.max_replicas}")
    inputs = _inputs(settings, obs)
    current = obs.current_replicas
    if obs.error is not None:
        return Decision(current, f"Prometheus query failed, replicas unchanged: {obs.error}", False,
                        "PrometheusUnavailable", inputs)

    lo, hi = settings.min_replicas, settings.max_replicas
    if current == 0:
        if obs.router_held is None:
            return Decision(0, "at zero replicas the router's queue metric (pagoda_router:queue_length) is "
                            "missing, so held requests cannot be seen; replicas unchanged", False,
                            "MetricsMissing", inputs)
        if obs.router_held > 0 or (obs.waiting or 0) > 0:
            want = min(max(1, lo), hi)
            history.recommendations.append((now, want))
            return Decision(want, f"scale from zero: {obs.router_held:g} requests held by the router -> {want}",
                            True, "ScaleFromZero", inputs, want)
        want = min(lo, hi)
        return Decision(want, "no replica and no request held" + (f"; raising to minReplicas {lo}" if want else ""),
                        True, "ScaledToMinimum" if want else "Idle", inputs, want)

    metric_name, value = _metric_of(settings, obs)
    if value is None:
        return Decision(current, f"metric {metric_name} is missing for a service with {current} replicas; "
                        "replicas unchanged", False, "MetricsMissing", inputs)
    if math.isnan(value) or math.isinf(value):
        value = 0.0  # a quantile over no traffic

    rec, why = _recommend(settings, obs, value)
    rec = min(max(rec, lo), hi)
    if rec == 0 and not _idle(obs):
        rec, why = 1, why + "; requests are still in flight, keeping 1"
    if rec == 0 and obs.ready_replicas < current:
        rec, why = 1, why + f"; a replica is still starting ({obs.ready_replicas}/{current} ready), keeping 1"

    if history.since is None:
        history.since = now
    history.recommendations.append((now, rec))
    horizon = now - max(settings.scale_up_delay_s, settings.scale_down_delay_s) - 1
    history.recommendations[:] = [(t, r) for t, r in history.recommendations if t >= horizon]

    final, delay_why = _stabilize(history, settings, current, now)
    if final > current:
        kind = "ScaledUp"
    elif final < current:
        kind = "ScaledToZero" if final == 0 else "ScaledDown"
    else:
        kind = "Steady"
    return Decision(final, f"{why}; {delay_why}", True, kind, inputs, rec)
