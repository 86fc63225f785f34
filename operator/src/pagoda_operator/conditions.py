"""The reconciler's part of the InferenceService status, computed from what the operator observed:
pure, so the handler can compare the result with the current status and write only when
something changed. What `compute_status` returns is exactly what the reconciler owns (it applies
it whole, by server-side apply: a field it leaves out is removed).

Conditions (Kubernetes conventions; each with its own observedGeneration, reason, message, and a
lastTransitionTime that moves only when its status changes):
  Validated    the spec is servable (False: the problems, with their arithmetic)
  Ready        the router and every desired engine replica are ready (False with reason
               ModelDownloadFailed when an engine pod's model-download init container failed:
               the downloader's last line, trimmed, in the message)
  Progressing  a rollout is under way (spec changed, pods being replaced or started)
  Degraded     something the spec asks for cannot be provided (a missing CRD, a failed apply)
Other condition types (ScalingReady, the autoscaler's) belong to their writers and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OWN_CONDITIONS = ("Ready", "Progressing", "Degraded", "Validated")
# render._download_container's init containers: the model's, speculative decoding's drafting model's,
# and spec.loras' (lora-download-<i>).
DOWNLOAD_CONTAINERS = ("model-download", "draft-download")
LORA_DOWNLOAD_PREFIX = "lora-download-"
# A termination message taken from the log (FallbackToLogsOnError) is its last 2048 bytes or 80
# lines; the condition keeps the last line, where the downloader writes why, at most this long.
DOWNLOAD_MESSAGE_CHARS = 300


@dataclass
class Observation:
    """What one reconcile (or a child's change) saw."""

    generation: int
    validated: bool | None = None  # None: not re-validated now (a child changed); keep the condition
    problems: list[str] = field(default_factory=list)
    degraded: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    engine: dict[str, Any] | None = None  # the engine Deployment or LeaderWorkerSet as read back
    router: dict[str, Any] | None = None  # the router Deployment as read back
    desired_replicas: int = 1
    selector: str | None = None
    url: str | None = None
    download_failure: str | None = None  # from model_download_failure(the engine pods)
    # spec.prefill: the prefill Deployment as read back, and the replicas it should have (None: not
    # disaggregated; `engine` and `desired_replicas` are then the decode pods').
    prefill: dict[str, Any] | None = None
    prefill_desired: int | None = None


def _workload_counts(obj: dict[str, Any] | None) -> dict[str, Any]:
    status = (obj or {}).get("status") or {}
    generation = int(((obj or {}).get("metadata") or {}).get("generation") or 0)
    # LeaderWorkerSet reports no observedGeneration; its counts are taken as current.
    unreported = generation if (obj or {}).get("kind") == "LeaderWorkerSet" else -1
    return {
        "replicas": int(status.get("replicas") or 0),
        "ready": int(status.get("readyReplicas") or 0),
        "updated": int(status.get("updatedReplicas") or 0),
        # Until its controller has seen the latest spec, a workload's counts describe an older one.
        "caught_up": obj is not None and int(status.get("observedGeneration", unreported)) >= generation,
    }


def model_download_failure(pods: list[dict[str, Any]]) -> str | None:
    """Why the first engine pod whose model-download (or draft-download) init container failed (exited non-zero, or
    waits in CrashLoopBackOff after such an exit) failed: pod, exit code and the termination
    message's last line, bounded. None when no pod's download failed (one retrying is running)."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name") or ""):
        for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if status.get("name") not in DOWNLOAD_CONTAINERS and not str(status.get("name")).startswith(LORA_DOWNLOAD_PREFIX):
                continue
            state = status.get("state") or {}
            terminated = state.get("terminated")
            if terminated is None and (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
                terminated = (status.get("lastState") or {}).get("terminated")
            if not terminated or not terminated.get("exitCode"):
                continue
            lines = [line.strip() for line in (terminated.get("message") or "").splitlines() if line.strip()]
            why = lines[-1] if lines else terminated.get("reason") or "no message"
            if len(why) > DOWNLOAD_MESSAGE_CHARS:
                why = why[:DOWNLOAD_MESSAGE_CHARS - 3] + "..."
            name = (pod.get("metadata") or {}).get("name")
            return f"pod {name}: {status['name']} exited {terminated['exitCode']}: {why}"
    return None


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str,
                  generation: int, now: str) -> list[dict[str, Any]]:
    """conditions with type_ set; lastTransitionTime kept unless the status flips."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    changed = old is None or old.get("status") != value
    new = {
        "type": type_,
        "status": value,
        "observedGeneration": generation,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
    }
    out = [c for c in conditions if c.get("type") != type_]
    out.append(new)
    return out


def compute_status(current: dict[str, Any] | None, obs: Observation, now: str) -> dict[str, Any]:
    """The status the InferenceService should have: the fields the reconciler owns, all of them.
    What obs does not say (a refresh decides no validity; an invalid spec has no url) is
    carried over from `current`."""
    current = current or {}
    conditions = [dict(c) for c in current.get("conditions") or [] if c.get("type") in OWN_CONDITIONS]
    gen = obs.generation
    if obs.validated is not None:
        if obs.validated:
            conditions = set_condition(conditions, "Validated", True, "Valid", "The spec is valid.", gen, now)
        else:
            conditions = set_condition(conditions, "Validated", False, "InvalidSpec",
                                       "Nothing was created or changed: " + "; ".join(obs.problems), gen, now)
        if not obs.validated:
            conditions = set_condition(conditions, "Degraded", False, "InvalidSpec",
                                       "Nothing is applied while the spec is invalid (see Validated).", gen, now)
        elif obs.degraded:
            reasons = [reason for reason, _ in obs.degraded]
            conditions = set_condition(conditions, "Degraded", True, reasons[0] if len(set(reasons)) == 1 else "Multiple",
                                       "; ".join(message for _, message in obs.degraded), gen, now)
        else:
            conditions = set_condition(conditions, "Degraded", False, "AsExpected", "Every child was applied.", gen, now)
    valid = next((c.get("status") == "True" for c in conditions if c.get("type") == "Validated"), True)

    engine, router = _workload_counts(obs.engine), _workload_counts(obs.router)
    want = obs.desired_replicas
    router_ready = router["ready"] >= 1
    engine_ready = obs.engine is not None and engine["ready"] >= want and engine["caught_up"]
    disaggregated = obs.prefill_desired is not None
    prefill, prefill_want = _workload_counts(obs.prefill), obs.prefill_desired or 0
    prefill_ready = not disaggregated or (obs.prefill is not None and prefill["ready"] >= prefill_want and prefill["caught_up"])
    counted = (f"{engine['ready']}/{want} decode and {prefill['ready']}/{prefill_want} prefill replicas ready"
               if disaggregated else f"{engine['ready']}/{want} engine replicas ready")
    if obs.engine is None or (disaggregated and obs.prefill is None):
        ready, reason, message = False, ("InvalidSpec" if not valid else "EngineMissing"), "No engine workload exists."
    elif not router_ready:
        ready, reason, message = False, "RouterNotReady", "The router has no ready pod."
    elif want == 0:
        ready, reason, message = True, "ScaledToZero", "No engine replicas; the router holds requests until one starts."
    elif engine_ready and prefill_ready:
        ready, reason, message = True, "AllReplicasReady", f"{counted}."
    elif obs.download_failure is not None:
        ready, reason, message = (False, "ModelDownloadFailed",
                                  f"{counted}; the model download failed in {obs.download_failure}")
    else:
        ready, reason, message = False, "ReplicasNotReady", f"{counted}."
    conditions = set_condition(conditions, "Ready", ready, reason, message, gen, now)

    rolled_out = obs.engine is not None and engine["caught_up"] and engine["updated"] >= want and engine["replicas"] == want and engine["ready"] >= want
    if disaggregated:  # the prefill pods' rollout too
        rolled_out = rolled_out and obs.prefill is not None and prefill["caught_up"] and prefill["updated"] >= prefill_want \
            and prefill["replicas"] == prefill_want and prefill["ready"] >= prefill_want
    if obs.engine is None:
        conditions = set_condition(conditions, "Progressing", False, "NoWorkload", "No engine workload exists.", gen, now)
    elif rolled_out:
        conditions = set_condition(conditions, "Progressing", False, "RolloutComplete", f"{want} engine replicas up to date.", gen, now)
    else:
        conditions = set_condition(conditions, "Progressing", True, "RollingOut",
                                   f"{engine['updated']}/{want} engine replicas updated, {engine['ready']} ready.", gen, now)

    order = {t: i for i, t in enumerate(OWN_CONDITIONS)}
    conditions.sort(key=lambda c: order[c["type"]])
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "conditions": conditions,
        "replicas": engine["replicas"],
        "readyReplicas": engine["ready"],
    }
    if disaggregated:
        status["roles"] = [{"name": "prefill", "replicas": prefill["replicas"], "readyReplicas": prefill["ready"]},
                           {"name": "decode", "replicas": engine["replicas"], "readyReplicas": engine["ready"]}]
    for key, value in (("selector", obs.selector), ("url", obs.url)):
        if value is not None:
            status[key] = value
        elif key in current:
            status[key] = current[key]
    return status


def is_current(current: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Does `current` already hold every field of `new` (conditions compared by type, whatever
    their order and whatever other writers' conditions sit beside them)?"""
    current = current or {}
    by_type = {c.get("type"): c for c in current.get("conditions") or []}
    return all(by_type.get(c["type"]) == c for c in new.get("conditions") or []) and \
        all(current.get(key) == value for key, value in new.items() if key != "conditions")


def transitions(old: dict[str, Any] | None, new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Events for condition changes worth telling a user: (type Normal|Warning, reason, message)."""
    before = {c["type"]: c for c in (old or {}).get("conditions") or []}
    events = []
    for c in new.get("conditions") or []:
        if c["type"] not in OWN_CONDITIONS:
            continue
        prev = before.get(c["type"])
        if prev is not None and prev.get("status") == c["status"] and prev.get("reason") == c["reason"]:
            continue
        if c["type"] == "Validated" and c["status"] == "False":
            events.append(("Warning", "InvalidSpec", c["message"]))
        elif c["type"] == "Validated" and prev is not None:
            events.append(("Normal", "Valid", c["message"]))
        elif c["type"] == "Degraded" and c["status"] == "True":
            events.append(("Warning", c["reason"], c["message"]))
        elif c["type"] == "Degraded" and prev is not None and prev.get("status") == "True":
            events.append(("Normal", "Recovered", c["message"]))
        elif c["type"] == "Ready" and c["status"] == "True":
            events.append(("Normal", "Ready", c["message"]))
        elif c["type"] == "Ready" and prev is not None and prev.get("status") == "True":
            events.append(("Warning", "NotReady", c["message"]))
    return events
