"""Status computation: conditions from children, transition times, Events, others' conditions."""

from __future__ import annotations

from pagoda_operator.conditions import (DOWNLOAD_MESSAGE_CHARS, Observation, compute_status, is_current,
                                        model_download_failure, transitions)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(generation: int, observed: int, replicas: int, ready: int, updated: int) -> dict:
    return {"kind": "Deployment", "metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}}


def by_type(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_ready_when_router_and_every_replica_are_ready():
    obs = Observation(generation=3, validated=True, engine=deployment(2, 2, 2, 2, 2), router=deployment(1, 1, 1, 1, 1), desired_replicas=2)
    status = compute_status(None, obs, T0)
    assert by_type(status) == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
                               "Degraded": ("False", "AsExpected"), "Validated": ("True", "Valid")}
    assert status["observedGeneration"] == 3 and status["replicas"] == 2 and status["readyReplicas"] == 2
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])


def test_a_workload_whose_controller_lags_is_progressing_not_ready():
    obs = Observation(generation=2, validated=True, engine=deployment(5, 4, 2, 2, 2), router=deployment(1, 1, 1, 1, 1), desired_replicas=2)
    assert by_type(compute_status(None, obs, T0))["Ready"] == ("False", "ReplicasNotReady")
    assert by_type(compute_status(None, obs, T0))["Progressing"] == ("True", "RollingOut")


def test_transition_time_moves_only_when_the_status_flips():
    base = dict(generation=1, validated=True, router=deployment(1, 1, 1, 1, 1), desired_replicas=1)
    first = compute_status(None, Observation(**base, engine=deployment(1, 1, 1, 0, 1)), T0)
    again = compute_status(first, Observation(**base, engine=deployment(1, 1, 1, 0, 1)), T1)
    assert again == first  # nothing changed: identical status, so no write
    ready = compute_status(first, Observation(**base, engine=deployment(1, 1, 1, 1, 1)), T1)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0, "Validated": T0}


def test_the_autoscalers_conditions_and_fields_are_not_the_reconcilers():
    scaling = {"type": "ScalingReady", "status": "False", "reason": "PrometheusUnreachable", "message": "x",
               "lastTransitionTime": T0, "observedGeneration": 1}
    current = {"conditions": [scaling], "autoscaling": {"desiredReplicas": 4}}
    status = compute_status(current, Observation(generation=1, validated=True, desired_replicas=1), T1)
    # What the reconciler applies is what it owns: ScalingReady and autoscaling stay the autoscaler's.
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "Validated"]
    assert "autoscaling" not in status
    # Applied, the status holds both writers' conditions (in any order): nothing left to write.
    applied = {**current, **status, "conditions": [scaling] + status["conditions"]}
    assert is_current(applied, compute_status(applied, Observation(generation=1, validated=True, desired_replicas=1), T1))
    assert not is_current(current, status)


def test_invalid_spec_and_missing_crds():
    invalid = compute_status(None, Observation(generation=1, validated=False, problems=["a: b", "c: d"]), T0)
    conds = {c["type"]: c for c in invalid["conditions"]}
    assert conds["Validated"]["message"] == "Nothing was created or changed: a: b; c: d"
    assert (conds["Ready"]["reason"], conds["Degraded"]["reason"]) == ("InvalidSpec", "InvalidSpec")
    degraded = compute_status(None, Observation(generation=1, validated=True, degraded=[("LeaderWorkerSetMissing", "no LWS")]), T0)
    assert by_type(degraded)["Degraded"] == ("True", "LeaderWorkerSetMissing")
    both = compute_status(None, Observation(generation=1, validated=True, degraded=[("A", "a"), ("B", "b")]), T0)
    assert by_type(both)["Degraded"] == ("True", "Multiple")


def test_child_refresh_keeps_validation_conditions():
    first = compute_status(None, Observation(generation=1, validated=False, problems=["x: y"]), T0)
    refreshed = compute_status(first, Observation(generation=1, engine=deployment(1, 1, 1, 1, 1), router=deployment(1, 1, 1, 1, 1)), T1)
    assert by_type(refreshed)["Validated"] == ("False", "InvalidSpec")


def test_scaled_to_zero_is_ready_while_the_router_runs():
    obs = Observation(generation=1, validated=True, engine=deployment(1, 1, 0, 0, 0), router=deployment(1, 1, 1, 1, 1), desired_replicas=0)
    assert by_type(compute_status(None, obs, T0))["Ready"] == ("True", "ScaledToZero")


def test_events_on_transitions_only():
    router = deployment(1, 1, 1, 1, 1)
    pending = compute_status(None, Observation(generation=1, validated=True, engine=deployment(1, 1, 1, 0, 1), router=router), T0)
    assert transitions(None, pending) == []  # a new, valid, not yet ready service: nothing to tell
    ready = compute_status(pending, Observation(generation=1, validated=True, engine=deployment(1, 1, 1, 1, 1), router=router), T1)
    assert transitions(pending, ready) == [("Normal", "Ready", "1/1 engine replicas ready.")]
    assert transitions(ready, ready) == []
    broken = compute_status(ready, Observation(generation=2, validated=False, problems=["p: q"], engine=deployment(1, 1, 1, 1, 1), router=router), T1)
    assert transitions(ready, broken) == [("Warning", "InvalidSpec", "Nothing was created or changed: p: q")]


def pod(name: str, *init_statuses: dict) -> dict:
    return {"metadata": {"name": name}, "status": {"initContainerStatuses": list(init_statuses)}}


def test_a_failed_model_download_is_found_in_the_engine_pods():
    log = "attempt 1 of 3 failed\npagoda s3: downloading s3://b/m refused: AccessDenied\n\n"
    exited = {"name": "model-download", "state": {"terminated": {"exitCode": 3, "reason": "Error", "message": log}}}
    backing_off = {"name": "model-download", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                   "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": log}}}
    reason = "pagoda s3: downloading s3://b/m refused: AccessDenied"
    assert model_download_failure([pod("p", exited)]) == f"pod p: model-download exited 3: {reason}"
    assert model_download_failure([pod("p", backing_off)]) == f"pod p: model-download exited 3: {reason}"
    draft = {**exited, "name": "draft-download"}  # speculative decoding's drafting model
    assert model_download_failure([pod("p", draft)]) == f"pod p: draft-download exited 3: {reason}"
    # Succeeded, or retrying now (running after a failure), or another init container: no failure.
    done = {"name": "model-download", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    retrying = {"name": "model-download", "state": {"running": {}}, "lastState": exited["state"]}
    other = {"name": "setup", "state": {"terminated": {"exitCode": 1, "message": "no"}}}
    assert model_download_failure([pod("a", done), pod("b", retrying), pod("c", other), pod("d")]) is None
    # No message (killed): the kubelet's reason; a long line: bounded.
    killed = {"name": "model-download", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    assert model_download_failure([pod("p", killed)]) == "pod p: model-download exited 137: OOMKilled"
    long = {"name": "model-download", "state": {"terminated": {"exitCode": 3, "message": "y" * 5000}}}
    found = model_download_failure([pod("p", long)])
    assert found.endswith("...") and len(found) == len("pod p: model-download exited 3: ") + DOWNLOAD_MESSAGE_CHARS


def test_a_failed_download_makes_ready_false_with_its_reason_until_replicas_are_ready():
    failure = "pod p: model-download exited 3: refused"
    obs = Observation(generation=1, validated=True, engine=deployment(1, 1, 1, 0, 1), router=deployment(1, 1, 1, 1, 1),
                      desired_replicas=1, download_failure=failure)
    ready = next(c for c in compute_status(None, obs, T0)["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelDownloadFailed")
    assert ready["message"] == "0/1 engine replicas ready; the model download failed in " + failure
    # Every replica ready (another pod's download worked, the failed one is gone or irrelevant): Ready.
    obs.engine = deployment(1, 1, 1, 1, 1)
    assert by_type(compute_status(None, obs, T0))["Ready"] == ("True", "AllReplicasReady")
