"""The autoscaling decision function, table by table: thresholds, delays, bounds, zero, stale."""

import math

import pytest

from pagoda_operator.autoscaler.decision import History, Observation, Settings, decide


def S(**kw):
    base = dict(min_replicas=1, max_replicas=8, policy="queue", target=2.0, scale_up_delay_s=0.0,
                scale_down_delay_s=60.0)
    base.update(kw)
    return Settings(**base)


def O(current=2, ready=None, waiting=0.0, running=0.0, held=0.0, **kw):
    return Observation(current_replicas=current, ready_replicas=current if ready is None else ready,
                       waiting=waiting, running=running, router_held=held, **kw)


@pytest.mark.parametrize("settings, obs, want, reason", [
    # queue: waiting per ready replica against the target
    (S(), O(current=2, waiting=12), 6, "ScaledUp"),
    (S(), O(current=2, waiting=4), 2, "Steady"),  # exactly at target
    (S(), O(current=2, waiting=5), 3, "ScaledUp"),
    (S(), O(current=2, waiting=3, held=3), 3, "ScaledUp"),  # the router's held requests count
    (S(max_replicas=4), O(current=2, waiting=100), 4, "ScaledUp"),  # bounded by max
    (S(), O(current=3, ready=1, waiting=3), 3, "Steady"),  # 2 replicas starting will absorb it
    # kvUtilization / ttft: proportional with a tolerance band
    (S(policy="kvUtilization", target=0.5), O(current=2, kv_usage=0.9), 4, "ScaledUp"),
    (S(policy="kvUtilization", target=0.5), O(current=2, kv_usage=0.53), 2, "Steady"),
    (S(policy="ttft", target=0.5), O(current=1, ttft_p90=1.6), 4, "ScaledUp"),
    (S(policy="ttft", target=0.5), O(current=1, ttft_p90=math.nan), 1, "Steady"),  # no traffic: min bound
    # at zero
    (S(min_replicas=0), O(current=0, waiting=None, running=None, held=3), 1, "ScaleFromZero"),
    (S(min_replicas=0, scale_up_delay_s=600), O(current=0, waiting=None, running=None, held=1), 1, "ScaleFromZero"),
    (S(min_replicas=2), O(current=0, waiting=None, running=None, held=5), 2, "ScaleFromZero"),
    (S(min_replicas=0), O(current=0, waiting=None, running=None, held=0), 0, "Idle"),
    (S(min_replicas=1), O(current=0, waiting=None, running=None, held=0), 1, "ScaledToMinimum"),
])
def test_first_decision(settings, obs, want, reason):
    d = decide(settings, obs, History(), now=1000.0)
    assert (d.replicas, d.condition_reason) == (want, reason), d.reason
    assert d.scaling_ready


@pytest.mark.parametrize("obs, reason, text", [
    (O(error="connection refused"), "PrometheusUnavailable", "connection refused"),
    (O(waiting=None), "MetricsMissing", "pagoda:num_requests_waiting"),
    (O(current=0, waiting=None, held=None), "MetricsMissing", "pagoda_router:queue_length"),
])
def test_unreachable_or_missing_metrics_change_nothing_and_clear_scaling_ready(obs, reason, text):
    d = decide(S(), obs, History(), now=0.0)
    assert d.replicas == obs.current_replicas and not d.scaling_ready
    assert d.condition_reason == reason and text in d.reason


def run(settings, observations, step=10.0):
    """Feed observations every `step` seconds, applying each decision; return the replica trace."""
    history, current, trace = History(), observations[0].current_replicas, []
    for i, obs in enumerate(observations):
        obs = Observation(**{**obs.__dict__, "current_replicas": current,
                             "ready_replicas": min(obs.ready_replicas, current) if obs.ready_replicas else current})
        current = decide(settings, obs, history, now=i * step).replicas
        trace.append(current)
    return trace


def test_scale_up_waits_for_the_delay_and_a_short_spike_does_nothing():
    s = S(scale_up_delay_s=30, max_replicas=16)
    burst = [O(waiting=20)] * 5
    assert run(s, burst) == [2, 2, 2, 10, 10]  # asked at t=0,10,20,30: only at 30s is the window full
    spike = [O(waiting=20), O(waiting=20), O(waiting=0, running=2), O(waiting=20), O(waiting=20)]
    assert run(s, spike) == [2, 2, 2, 2, 2]


def test_scale_down_steps_one_replica_per_delay_and_never_flaps():
    s = S(scale_down_delay_s=30)
    quiet = [O(current=4, waiting=0, running=1)] * 12
    assert run(s, quiet) == [4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1]  # each level must be asked for 30s
    # load in the middle of the window resets it
    mixed = [O(current=4, waiting=0, running=1)] * 2 + [O(current=4, waiting=8)] + [O(current=4, waiting=0, running=1)] * 4
    assert run(s, mixed) == [4, 4, 4, 4, 4, 4, 3]  # 30 s after the load at t=20


def test_restart_does_not_scale_down_at_once():
    # a fresh History (operator restarted) must first see a whole scaleDownDelay of low demand
    s = S(policy="kvUtilization", target=0.5, scale_down_delay_s=60)
    d = decide(s, O(current=4, kv_usage=0.05), History(), now=5000.0)
    assert d.replicas == 4 and d.recommendation == 1 and "scaleDownDelay" in d.reason


def test_scale_to_zero_only_when_idle_and_no_replica_is_starting():
    s = S(min_replicas=0, policy="kvUtilization", target=0.5, scale_down_delay_s=0)
    assert decide(s, O(current=1, kv_usage=0.0), History(), 0).replicas == 0
    assert decide(s, O(current=1, kv_usage=0.0, held=2), History(), 0).replicas == 1
    assert decide(s, O(current=1, kv_usage=0.0, running=1), History(), 0).replicas == 1
    starting = decide(s, O(current=2, ready=1, kv_usage=0.0), History(), 0)
    assert starting.replicas == 1 and "still starting" in starting.reason
    assert decide(S(min_replicas=1, scale_down_delay_s=0, policy="kvUtilization", target=0.5),
                  O(current=1, kv_usage=0.0), History(), 0).replicas == 1


def test_decision_records_inputs_and_the_arithmetic():
    d = decide(S(), O(current=2, waiting=12, running=4, held=0), History(), 0)
    assert d.inputs == {"policy": "queue", "target": 2.0, "currentReplicas": 2, "readyReplicas": 2,
                        "waiting": 12.0, "running": 4.0, "routerHeld": 0.0}
    assert "ceil(12/2) = 6" in d.reason


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="minReplicas 3 > maxReplicas 2"):
        decide(S(min_replicas=3, max_replicas=2), O(), History(), 0)
    with pytest.raises(ValueError, match="unknown autoscaling policy"):
        decide(S(policy="cpu"), O(), History(), 0)


def P(current=1, waiting=0.0, running=0.0, **kw):
    """An observation of a disaggregated service's prefill pods: no router_held (the router holds
    requests for the decode pods only, prometheus.queries reads none for the prefill role)."""
    return Observation(current_replicas=current, ready_replicas=current, waiting=waiting, running=running, **kw)


@pytest.mark.parametrize("settings, obs, want, reason", [
    (S(max_replicas=3), P(current=1, waiting=6), 3, "ScaledUp"),  # ceil(6/2)
    (S(max_replicas=3), P(current=1, waiting=40), 3, "ScaledUp"),  # bounded by max
    (S(), P(current=2, waiting=3), 2, "Steady"),  # 1.5 per ready prefill replica <= 2
    (S(scale_down_delay_s=0), P(current=3, waiting=0, running=2), 2, "ScaledDown"),  # one step down
    (S(scale_down_delay_s=0), P(current=1, waiting=0), 1, "Steady"),  # minReplicas
    (S(policy="ttft", target=0.5), P(current=2, ttft_p90=1.2), 5, "ScaledUp"),  # ceil(2 x 2.4)
    (S(policy="ttft", target=0.5, scale_down_delay_s=0), P(current=4, ttft_p90=0.2), 2, "ScaledDown"),  # ceil(4 x 0.4)
    (S(policy="ttft", target=0.5), P(current=2, ttft_p90=0.52), 2, "Steady"),  # within the tolerance
])
def test_prefill_decisions_without_the_routers_held_requests(settings, obs, want, reason):
    d = decide(settings, obs, History(), now=1000.0)
    assert (d.replicas, d.condition_reason) == (want, reason), d.reason
    assert d.scaling_ready and "routerHeld" not in d.inputs


def test_a_prefill_queue_at_target_per_ready_replica_counts_the_ready_ones_only():
    # 3 replicas, 1 ready: 4 waiting is 4 per ready replica > 2 -> ceil(4/2) = 2 (< current: the
    # starting ones already absorb it, the down step waits for scaleDownDelay)
    d = decide(S(), Observation(current_replicas=3, ready_replicas=1, waiting=4.0, running=1.0), History(), 0.0)
    assert (d.replicas, d.recommendation) == (3, 2) and "scaleDownDelay" in d.reason


@pytest.mark.parametrize("itl, current, want, reason", [
    (0.1, 2, 4, "ScaledUp"),  # ceil(2 x 0.1/0.05)
    (0.052, 2, 2, "Steady"),  # within 10 % of 50 ms
    (math.nan, 2, 1, "ScaledDown"),  # no tokens streamed: the minimum
])
def test_itl_scales_the_decode_pods_proportionally(itl, current, want, reason):
    s = S(policy="itl", target=None, scale_down_delay_s=0)
    assert s.effective_target == 0.05
    d = decide(s, O(current=current, itl_p90=itl), History(), 0.0)
    assert (d.replicas, d.condition_reason) == (want, reason), d.reason
    assert "itlP90Seconds" in d.inputs


def test_a_missing_itl_histogram_changes_nothing():
    d = decide(S(policy="itl"), O(current=2), History(), 0.0)
    assert (d.replicas, d.scaling_ready, d.condition_reason) == (2, False, "MetricsMissing")
    assert "pagoda:inter_token_latency_seconds" in d.reason
