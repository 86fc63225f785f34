"""kopf wiring: when to reconcile an InferenceService, and the reconcile itself.

reconcile (create, update, resume; and a slow timer while an optional CRD is missing):
  validate → if invalid: Validated=False, nothing applied → else server-side apply every child
  the renderer returns (optional kinds only when their CRD exists) → status from the children.
Children the spec no longer asks for are deleted (pruned) after a successful apply.
A child Deployment/LeaderWorkerSet changing (pods becoming ready) refreshes the owner's status,
and so does any change of the InferenceService itself (another writer of its status may have
sent older conditions).
Deletion needs no handler: every child has an owner reference, the garbage collector removes it.

Writes happen only when something differs: server-side apply of identical content changes
nothing on the server, and the status is compared before it is patched. Problems a user can
cause end in conditions and Events, never in an exception that kopf would retry forever.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import kopf

from pagoda_operator import render as r
from pagoda_operator.conditions import Observation, compute_status, transitions
from pagoda_operator.kube import ApiError, KubeClient
from pagoda_operator.quantity import format_gib, gib
from pagoda_operator.spec import GROUP, KIND, PLURAL, VERSION, desired_replicas
from pagoda_operator.validation import check


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
    ("keda.sh/v1alpha1", "ScaledObject"): (
        "KEDAMissing",
        "the ScaledObject CRD (keda.sh/v1alpha1) is not installed, so spec.autoscaling.driver: keda cannot scale; "
        "install KEDA (https://keda.sh) or use driver builtin",
    ),
}
MISSING_CRD_RECHECK_SECONDS = 60
STATUS_WRITE_ATTEMPTS = 5
MANAGED = {"app.kubernetes.io/managed-by": r.FIELD_MANAGER}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _kube(memo: Any) -> KubeClient:
    if getattr(memo, "kube", None) is None:
        memo.kube = KubeClient()
    return memo.kube


def _images(memo: Any) -> r.Images:
    return getattr(memo, "images", None) or r.Images.from_env()


async def _engine_and_router(kube: KubeClient, namespace: str, name: str, nodes: int | None) -> tuple[dict | None, dict | None]:
    engine_kind = (f"{r.LWS_GROUP}/v1", "LeaderWorkerSet") if (nodes or 1) > 1 else ("apps/v1", "Deployment")
    engine = await kube.get(*engine_kind, namespace, r.engine_name(name))  # None also when LWS is not installed
    router = await kube.get("apps/v1", "Deployment", namespace, name)
    return engine, router


async def write_status(kube: KubeClient, body: dict[str, Any], obs_for: Any) -> None:
    """Compute the status from a fresh read and patch it when it differs; post Events for
    transitions. obs_for(current_body) builds the Observation (it may read children).

    After a write it looks once more: a child that changed between our reads and our write
    raised an event whose refresh found no status to refresh yet, so this pass catches it."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    for _ in range(STATUS_WRITE_ATTEMPTS):
        current = await kube.get(f"{GROUP}/{VERSION}", KIND, namespace, name)
        if current is None:
            return  # deleted meanwhile
        obs = await obs_for(current)
        if obs is None:
            return
        old = current.get("status") or {}
        new = compute_status(old, obs, _now())
        if all(old.get(key) == value for key, value in new.items()):
            return  # nothing to write: an unchanged spec makes no write
        try:
            await kube.patch_status(namespace, name, new, current["metadata"].get("resourceVersion"))
        except ApiError as e:
            if e.status == 409:
                continue  # written by someone else in between: recompute from their version
            raise
        for type_, reason, message in transitions(old, new):
            kopf.event(current, type=type_, reason=reason, message=message[:1000])


async def reconcile(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    kube = _kube(memo)
    body = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": dict(body.get("metadata") or {}), "spec": dict(body.get("spec") or {})}
    meta = body["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    generation = int(meta.get("generation") or 1)
    checked = check(body)
    degraded: list[tuple[str, str]] = []
    apply_failed = False
    if not checked.ok:
        logger.warning("InferenceService %s/%s is invalid: %s", namespace, name, "; ".join(checked.problems))
    else:
        rendered = r.render(body, checked.spec, _images(memo))
        served = {key: await kube.has_kind(*key) for key in OPTIONAL_KINDS}
        for manifest in rendered:
            key = (manifest["apiVersion"], manifest["kind"])
            if not served.get(key, True):
                degraded.append(OPTIONAL_KINDS[key])
                continue
            try:
                await kube.apply(manifest)
            except ApiError as e:
                apply_failed = True
                degraded.append(("ApplyFailed", f"{manifest['kind']} {manifest['metadata']['name']}: {e}"))
        if not apply_failed:
            await prune(kube, body, rendered, served)
    spec = checked.spec

    async def observe(current: dict[str, Any]) -> Observation:
        engine, router = await _engine_and_router(kube, namespace, name, spec.topology.nodes if spec else None)
        obs = Observation(
            generation=generation,
            validated=checked.ok,
            problems=checked.problems,
            degraded=degraded,
            engine=engine,
            router=router,
        )
        if spec is not None:
            obs.desired_replicas = desired_replicas(spec)
            obs.selector = r.engine_selector(name)
            obs.url = r.service_url(name, namespace, spec)
            obs.kv_tiers = [{"type": t.type, "capacity": format_gib(gib(t.size)) if t.size else "unbounded"} for t in spec.kv_cache.tiers]
        return obs

    await write_status(kube, body, observe)
    if apply_failed:
        # The API server refused a child (quota, admission, RBAC): retried with a delay; the
        # Degraded condition already says why.
        raise kopf.TemporaryError("applying children failed; see the Degraded condition", delay=30)


async def prune(kube: KubeClient, body: dict[str, Any], rendered: list[dict[str, Any]], served: dict[tuple[str, str], bool]) -> None:
    """Delete children the spec no longer asks for (an Ingress switched off, the Deployment after
    a move to a LeaderWorkerSet): those of this InferenceService, by label and owner uid, that
    the renderer did not return."""
    meta = body["metadata"]
    namespace, name, uid = meta.get("namespace"), meta["name"], meta.get("uid")
    keep = {(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in rendered}
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by={r.FIELD_MANAGER}"
    for api_version, kind in r.CHILD_KINDS:
        if not served.get((api_version, kind), True):
            continue
        for child in await kube.list(api_version, kind, namespace, selector):
            child_meta = child.get("metadata") or {}
            owned = any(ref.get("uid") == uid and ref.get("controller") for ref in child_meta.get("ownerReferences") or [])
            labelled = (child_meta.get("labels") or {}).get("app.kubernetes.io/instance") == name
            if owned and labelled and (api_version, kind, child_meta.get("name")) not in keep:
                await kube.delete(api_version, kind, namespace, child_meta["name"])


async def refresh(kube: KubeClient, namespace: str, name: str) -> None:
    """Recompute Ready/Progressing and the counts of a reconciled InferenceService from its
    children, keeping the conditions only a reconcile decides (Validated, Degraded)."""

    async def observe(current: dict[str, Any]) -> Observation | None:
        status = current.get("status") or {}
        if "observedGeneration" not in status:
            return None  # not reconciled yet; the reconcile will write the status
        checked = check(current)
        engine, router = await _engine_and_router(kube, namespace, name, checked.spec.topology.nodes if checked.spec else None)
        obs = Observation(generation=int(status["observedGeneration"]), engine=engine, router=router)
        if checked.spec is not None:
            obs.desired_replicas = desired_replicas(checked.spec)
        return obs

    await write_status(kube, {"metadata": {"namespace": namespace, "name": name}}, observe)


async def refresh_from_child(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child workload changed (pods ready, rollout progress): refresh the owner's status."""
    owner = next((ref for ref in body.get("metadata", {}).get("ownerReferences") or []
                  if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/")), None)
    if owner is not None:
        await refresh(_kube(memo), body["metadata"].get("namespace"), owner["name"])


async def refresh_self(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The InferenceService changed, its status included: another writer of the status (the
    autoscaler merges its condition into the list it read) may have sent an older Ready or
    Progressing; recomputing restores them, and writes nothing when they are current."""
    meta = body.get("metadata") or {}
    await refresh(_kube(memo), meta.get("namespace"), meta["name"])


def _missing_crd(status: dict[str, Any], **_: Any) -> bool:
    reasons = {reason for reason, _ in OPTIONAL_KINDS.values()}
    return any(c.get("type") == "Degraded" and c.get("status") == "True" and
               (c.get("reason") in reasons or c.get("reason") == "Multiple")
               for c in status.get("conditions") or [])


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping in annotations under our own prefix (not in status: the status
    # subresource belongs to the conditions).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Handler-level chatter stays in the log; users see the operator's own Events.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    kube = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()


def register(registry: kopf.OperatorRegistry, *, recheck_crds_seconds: float = MISSING_CRD_RECHECK_SECONDS) -> None:
    """Attach the handlers to a kopf registry (the default one when running, a fresh one in tests)."""
    resource = (GROUP, VERSION, PLURAL)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.cleanup(registry=registry)(cleanup)
    fn = reconcile
    for decorator in (kopf.on.resume, kopf.on.create, kopf.on.update):
        fn = decorator(*resource, registry=registry, id="reconcile")(fn)
    kopf.timer(*resource, registry=registry, id="recheck-crds", interval=recheck_crds_seconds,
               initial_delay=recheck_crds_seconds, when=_missing_crd)(reconcile)
    kopf.on.event(*resource, registry=registry, id="status-guard")(refresh_self)
    kopf.on.event("apps", "v1", "deployments", registry=registry, labels=MANAGED, id="child-deployment")(refresh_from_child)
    kopf.on.event(r.LWS_GROUP, "v1", "leaderworkersets", registry=registry, labels=MANAGED, id="child-lws")(refresh_from_child)


def run_operator(*, namespaces: list[str], clusterwide: bool, standalone: bool, liveness: str | None, verbosity: str) -> int:
    kopf.configure(verbose=verbosity == "verbose", debug=verbosity == "debug", quiet=verbosity == "quiet")
    registry = kopf.get_default_registry()
    register(registry)
    try:
        # The autoscaler (if present) registers its timers on import.
        import pagoda_operator.autoscaler.handlers  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name not in ("pagoda_operator.autoscaler", "pagoda_operator.autoscaler.handlers"):
            raise
    kopf.run(
        registry=registry,
        clusterwide=clusterwide and not namespaces,
        namespaces=namespaces,
        standalone=standalone,
        liveness_endpoint=liveness,
    )
    return 0
