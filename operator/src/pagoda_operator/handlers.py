"""kopf wiring: when to reconcile an InferenceService, and the reconcile itself.

reconcile (create, update, resume; and a slow timer while an optional CRD is missing):
  validate → if invalid: Validated=False, nothing applied → else create the internal-key Secret
  if absent (`ensure_internal_key`), server-side apply every child the renderer returns (optional
  kinds only when their CRD is served) → status from the children.
Children the spec no longer asks for are deleted (pruned) after a successful apply.
A child Deployment/LeaderWorkerSet changing (pods becoming ready) refreshes the owner's status.
While engine replicas are not ready, a timer refreshes it too, and each refresh lists the engine
pods: a failed model download changes no Deployment field, only its pod's init container status.
Deletion needs no handler: every child has an owner reference, the garbage collector removes it.

The status is written by server-side apply on the status subresource as `pagoda-operator`, which
owns the fields `conditions.compute_status` returns (Ready, Progressing, Degraded, Validated, the
counts, selector, url). The autoscaler applies its own (ScalingReady, autoscaling) as
`pagoda-autoscaler`, and the prefill role's (PrefillScalingReady, prefillAutoscaling) as
`pagoda-autoscaler-prefill`, and the KV tiers' figures (kvCache) are applied by `kv_status` as
`pagoda-kv-status`, the InferencePool's parents (inferencePool) by `pool_status` as
`pagoda-pool-status`, and the adapters' (loras) by `loras` as `pagoda-lora-status`; `conditions` is a map list keyed on type, so no writer can overwrite or drop
another's. With router.mode: gateway the reconcile lists the pool's InferenceObjectives for the
picker's ConfigMap; `objectives` rewrites that ConfigMap when an objective changes.

Writes happen only when something differs: server-side apply of identical content changes
nothing on the server, and the status is compared before it is applied. Problems a user can
cause end in conditions and Events, never in an exception that kopf would retry forever.
"""

from __future__ import annotations

import datetime
import logging
import secrets
from typing import Any

import kopf
from lightkube import AsyncClient

from pagoda_operator import kube, kv_status, loras, metrics, objectives, pool_status
from pagoda_operator import render as r
from pagoda_operator.autoscaler import handlers as autoscaler
from pagoda_operator.autoscaler.scaledobjects import scaled_directly
from pagoda_operator.children import FIELD_MANAGER, selector_labels
from pagoda_operator.conditions import Observation, compute_status, is_current, model_download_failure, transitions
from pagoda_operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, desired_replicas, role_spec
from pagoda_operator.validation import Checked, check


# Kinds whose CRDs a cluster may lack: (apiVersion, kind) → (Degraded reason, what it costs).
OPTIONAL_KINDS = {
    (f"{r.LWS_GROUP}/v1", "LeaderWorkerSet"): (
        "LeaderWorkerSetMissing",
        "the LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1) is not installed, so the multi-node engine "
        "(topology.nodes > 1) cannot run; install LWS (https://lws.sigs.k8s.io)",
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "ServiceMonitorCRDMissing",
        "the ServiceMonitor CRD (monitoring.coreos.com/v1) is not installed, so no ServiceMonitor was created; "
        "install the Prometheus operator or set spec.monitoring.serviceMonitor: false",
    ),
    (r.INFERENCE_POOL_API_VERSION, "InferencePool"): (
        "InferencePoolCRDMissing",
        "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed, so router.mode: gateway has no "
        "pool for the gateway; install the Gateway API inference extension's CRDs",
    ),
    (r.HTTPROUTE_API_VERSION, "HTTPRoute"): (
        "HTTPRouteCRDMissing",
        "the HTTPRoute CRD (gateway.networking.k8s.io/v1) is not installed, so router.gateway.parentRefs got no "
        "HTTPRoute; install the Gateway API's CRDs",
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): (
        "KEDAMissing",
        "the ScaledObject CRD (keda.sh/v1alpha1) is not installed, so spec.autoscaling.driver: keda cannot scale; "
        "install KEDA (https://keda.sh) or use driver builtin",
    ),
}
MISSING_CRD_RECHECK_SECONDS = 60
NOT_READY_RECHECK_SECONDS = 30  # how soon a failed model download shows while replicas are not ready
RETRY_S = 5  # a reconcile that raised an unexpected error (not a refused child: that waits 30 s) is retried after this
INTERNAL_KEY_BYTES = 32  # of randomness in the router's key to the engines (256 bits)
MANAGED = {"app.kubernetes.io/managed-by": FIELD_MANAGER}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _images(memo: Any) -> r.Images:
    return getattr(memo, "images", None) or r.Images.from_env()


def _peers(memo: Any) -> r.NetworkPeers:
    return getattr(memo, "peers", None) or r.NetworkPeers.from_env()


async def _engine_and_router(client: AsyncClient, namespace: str, name: str, nodes: int | None,
                             disaggregated: bool = False) -> tuple[dict | None, dict | None]:
    """The engine workload (spec.prefill: the decode pods') and the router Deployment, as read back."""
    if disaggregated:
        engine = await kube.get(client, "apps/v1", "Deployment", namespace, r.role_name(name, "decode"))
    else:
        engine_kind = (f"{r.LWS_GROUP}/v1", "LeaderWorkerSet") if (nodes or 1) > 1 else ("apps/v1", "Deployment")
        engine = await kube.get(client, *engine_kind, namespace, r.engine_name(name))  # None also when LWS is not installed
    router = await kube.get(client, "apps/v1", "Deployment", namespace, name)
    return engine, router


async def observe(client: AsyncClient, current: dict[str, Any], checked: Checked, generation: int, **decided: Any) -> Observation:
    """What the children and the spec say now. `decided`: validated, problems, degraded, when a
    reconcile decided them (a refresh keeps the conditions it wrote)."""
    meta = current["metadata"]
    namespace, name, spec = meta.get("namespace"), meta["name"], checked.spec
    disaggregated = spec is not None and spec.prefill is not None
    engine, router = await _engine_and_router(client, namespace, name, spec.topology.nodes if spec else None, disaggregated)
    obs = Observation(generation=generation, engine=engine, router=router, **decided)
    if spec is not None:
        obs.desired_replicas = desired_replicas(spec)
        obs.selector = r.engine_selector(name, "decode" if disaggregated else None)
        if disaggregated:
            obs.prefill = await kube.get(client, "apps/v1", "Deployment", namespace, r.role_name(name, "prefill"))
            obs.prefill_desired = desired_replicas(role_spec(spec, "prefill"))
            if scaled_directly(spec, "prefill") and obs.prefill is not None:
                # Its KEDA or HPA scaler sets the Deployment's replicas: those are the count to be ready.
                obs.prefill_desired = int((obs.prefill.get("spec") or {}).get("replicas", obs.prefill_desired))
        obs.url = r.service_url(name, namespace, spec)
        if engine is not None and obs.desired_replicas > 0:
            obs.download_failure = await _download_failure(client, namespace, name)
    return obs


async def _download_failure(client: AsyncClient, namespace: str, name: str) -> str | None:
    """conditions.model_download_failure of the engine pods; None, logged, when they cannot be
    listed (the status then says ReplicasNotReady, as it did before)."""
    labels = selector_labels(name, "engine")
    try:
        pods = await kube.list_labelled(client, "v1", "Pod", namespace, labels)
    except kube.KubeError as e:
        logging.getLogger(__name__).warning("listing the engine pods of %s/%s failed: %s", namespace, name, e)
        return None
    return model_download_failure([p for p in pods if labels.items() <= ((p.get("metadata") or {}).get("labels") or {}).items()])


async def write_status(client: AsyncClient, namespace: str, name: str, observe_now: Any) -> None:
    """Compute the operator's part of the status from a fresh read and apply it when it differs;
    Events for transitions. observe_now(current) builds the Observation (None: write nothing).

    Looks twice: a child that changed between our read of it and our write raised an event whose
    refresh found no status to refresh yet (before the first reconcile's write); the second look
    catches it, and writes nothing when the first was current."""
    for _ in range(2):
        current = await kube.get(client, API_VERSION, KIND, namespace, name)
        if current is None:
            return  # deleted meanwhile
        obs = await observe_now(current)
        if obs is None:
            return
        old = current.get("status") or {}
        new = compute_status(old, obs, _now())
        if is_current(old, new):
            return  # nothing to write: an unchanged spec makes no write
        await kube.apply_status(client, namespace, name, new, FIELD_MANAGER)
        for type_, reason, message in transitions(old, new):
            kopf.event(current, type=type_, reason=reason, message=message[:1000])


async def reconcile(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    client = memo.kube
    body = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": dict(body.get("metadata") or {}), "spec": dict(body.get("spec") or {})}
    meta = body["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    checked = check(body)
    degraded: list[tuple[str, str]] = []
    apply_failed = False
    if not checked.ok:
        logger.warning("InferenceService %s/%s is invalid: %s", namespace, name, "; ".join(checked.problems))
    else:
        pool_objectives = None
        if checked.spec.router.mode == "gateway":
            try:
                pool_objectives = await objectives.pool_objectives(client, namespace, name)
            except kube.KubeError as e:
                # Applied without them, the picker would lose the priorities it has: nothing is
                # applied, and the reconcile is retried.
                apply_failed = True
                degraded.append(("InferenceObjectivesUnreadable", f"listing the InferenceObjectives failed: {e}"))
        rendered = r.render(body, checked.spec, _images(memo), _peers(memo), pool_objectives)
        served = {key: await kube.served(client, *key, namespace) for key in OPTIONAL_KINDS}
        try:
            if not apply_failed and await ensure_internal_key(client, body):
                logger.info("created the Secret %s", r.internal_key_secret_name(name))
        except kube.KubeError as e:
            apply_failed = True
            degraded.append(("ApplyFailed", f"Secret {r.internal_key_secret_name(name)}: {e}"))
        for manifest in ([] if apply_failed else rendered):
            key = (manifest["apiVersion"], manifest["kind"])
            if not served.get(key, True):
                degraded.append(OPTIONAL_KINDS[key])
                continue
            try:
                await kube.apply(client, manifest, FIELD_MANAGER)
            except kube.KubeError as e:
                if e.status == 404 and key in OPTIONAL_KINDS:
                    # The kind is gone since it was listed (its CRD removed, or a stale discovery):
                    # the same as missing, rechecked by the timer, not retried as a failure.
                    served[key] = False
                    degraded.append(OPTIONAL_KINDS[key])
                    continue
                apply_failed = True
                degraded.append(("ApplyFailed", f"{manifest['kind']} {manifest['metadata']['name']}: {e}"))
        if not apply_failed:
            await prune(client, body, rendered, served)

    async def observe_now(current: dict[str, Any]) -> Observation:
        return await observe(client, current, checked, int(meta.get("generation") or 1),
                             validated=checked.ok, problems=checked.problems, degraded=degraded)

    await write_status(client, namespace, name, observe_now)
    if apply_failed:
        # The API server refused a child (quota, admission, RBAC): retried with a delay; the
        # Degraded condition already says why.
        raise kopf.TemporaryError("applying children failed; see the Degraded condition", delay=30)


async def ensure_internal_key(client: AsyncClient, body: dict[str, Any]) -> bool:
    """The Secret <name>-internal-key, with a random key, when it does not exist yet (True: made
    now): created once, an existing one kept, so reconciles never rotate the key; made before the
    pods that read it; owned by the InferenceService, so the garbage collector removes it with it."""
    secret = r.render_internal_key_secret(body, secrets.token_urlsafe(INTERNAL_KEY_BYTES))
    return await kube.create(client, secret, FIELD_MANAGER)


async def prune(client: AsyncClient, body: dict[str, Any], rendered: list[dict[str, Any]], served: dict[tuple[str, str], bool]) -> None:
    """Delete children the spec no longer asks for (an Ingress switched off, the Deployment after
    a move to a LeaderWorkerSet): those of this InferenceService, by label and owner uid, that
    the renderer did not return."""
    meta = body["metadata"]
    namespace, name, uid = meta.get("namespace"), meta["name"], meta.get("uid")
    keep = {(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in rendered}
    selector = {"app.kubernetes.io/instance": name, **MANAGED}
    for api_version, kind in r.CHILD_KINDS:
        if not served.get((api_version, kind), True):
            continue
        try:
            children = await kube.list_labelled(client, api_version, kind, namespace, selector)
        except kube.KubeError as e:
            if e.status == 404:
                continue  # the kind is not served: none of it exists to prune
            raise
        for child in children:
            child_meta = child.get("metadata") or {}
            owned = any(ref.get("uid") == uid and ref.get("controller") for ref in child_meta.get("ownerReferences") or [])
            labelled = (child_meta.get("labels") or {}).get("app.kubernetes.io/instance") == name
            if owned and labelled and (api_version, kind, child_meta.get("name")) not in keep:
                await kube.delete(client, api_version, kind, namespace, child_meta["name"])


async def refresh(client: AsyncClient, namespace: str, name: str) -> None:
    """Recompute Ready/Progressing and the counts of a reconciled InferenceService from its
    children, keeping the conditions only a reconcile decides (Validated, Degraded)."""

    async def observe_now(current: dict[str, Any]) -> Observation | None:
        status = current.get("status") or {}
        if "observedGeneration" not in status:
            return None  # not reconciled yet; the reconcile will write the status
        return await observe(client, current, check(current), int(status["observedGeneration"]))

    await write_status(client, namespace, name, observe_now)


async def refresh_from_child(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child workload changed (pods ready, rollout progress): refresh the owner's status."""
    owner = next((ref for ref in body.get("metadata", {}).get("ownerReferences") or []
                  if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/")), None)
    if owner is not None:
        await refresh(memo.kube, body["metadata"].get("namespace"), owner["name"])


async def refresh_not_ready(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await refresh(memo.kube, body["metadata"].get("namespace"), body["metadata"]["name"])


def _replicas_not_ready(status: dict[str, Any], **_: Any) -> bool:
    return any(c.get("type") == "Ready" and c.get("reason") in ("ReplicasNotReady", "ModelDownloadFailed")
               for c in status.get("conditions") or [])


def _missing_crd(status: dict[str, Any], **_: Any) -> bool:
    reasons = {reason for reason, _ in OPTIONAL_KINDS.values()}
    return any(c.get("type") == "Degraded" and c.get("status") == "True" and
               (c.get("reason") in reasons or c.get("reason") == "Multiple")
               for c in status.get("conditions") or [])


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's bookkeeping in annotations under our own prefix (not in status: the status
    # subresource belongs to the conditions).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Handler-level chatter stays in the log; users see the operator's own Events.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # One client for every handler: the operator's memo is copied into each resource's.
    if getattr(memo, "kube", None) is None:
        memo.kube = kube.connect()


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    client = getattr(memo, "kube", None)
    if client is not None:
        await client.close()


def register(registry: kopf.OperatorRegistry, *, recheck_crds_seconds: float = MISSING_CRD_RECHECK_SECONDS,
             kv_status_seconds: float = kv_status.KV_STATUS_INTERVAL_S,
             not_ready_seconds: float = NOT_READY_RECHECK_SECONDS,
             lora_sync_seconds: float = loras.LORA_SYNC_INTERVAL_S) -> None:
    """Attach the reconciler's and the autoscaler's handlers to a kopf registry (the default one
    when running, a fresh one in tests). Handlers find the API client in memo.kube."""
    resource = (GROUP, VERSION, PLURAL)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.cleanup(registry=registry)(cleanup)
    fn = reconcile
    for decorator in (kopf.on.resume, kopf.on.create, kopf.on.update):
        # An unexpected error (an API call timed out) is retried after RETRY_S, not kopf's 60 s.
        fn = decorator(*resource, registry=registry, id="reconcile", backoff=RETRY_S)(fn)
    kopf.timer(*resource, registry=registry, id="recheck-crds", interval=recheck_crds_seconds,
               initial_delay=recheck_crds_seconds, when=_missing_crd)(reconcile)
    kopf.timer(*resource, registry=registry, id="refresh-not-ready", interval=not_ready_seconds,
               initial_delay=not_ready_seconds, when=_replicas_not_ready)(refresh_not_ready)
    kopf.on.event("apps", "v1", "deployments", registry=registry, labels=MANAGED, id="child-deployment")(refresh_from_child)
    kopf.on.event(r.LWS_GROUP, "v1", "leaderworkersets", registry=registry, labels=MANAGED, id="child-lws")(refresh_from_child)
    autoscaler.register(registry)
    kv_status.register(registry, interval_s=kv_status_seconds)
    loras.register(registry, interval_s=lora_sync_seconds)
    objectives.register(registry)
    pool_status.register(registry)


def run_operator(*, namespaces: list[str], clusterwide: bool, standalone: bool, liveness: str | None, verbosity: str,
                 metrics_port: int | None = None) -> int:
    kopf.configure(verbose=verbosity == "verbose", debug=verbosity == "debug", quiet=verbosity == "quiet")
    if metrics_port:
        metrics.serve(metrics_port)
    registry = kopf.get_default_registry()
    register(registry)
    kopf.run(
        registry=registry,
        clusterwide=clusterwide and not namespaces,
        namespaces=namespaces,
        standalone=standalone,
        liveness_endpoint=liveness,
    )
    return 0
