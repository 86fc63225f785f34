"""status.inferencePool: what the gateways say of a service's InferencePool (router.mode: gateway).

A Gateway's controller that takes the pool up writes, in the pool's `status.parents`, one entry per
Gateway with its conditions `Accepted` (the Gateway admits routes to the pool) and
`ResolvedRefs` (the pool's endpoint picker Service resolves). The operator watches the
InferencePools it made and copies each parent's reference and those conditions into the owning
InferenceService's `status.inferencePool.parents`, applied as its own field manager,
`pagoda-pool-status` (the reconciler, the autoscaler and the KV-tier reader own the rest of the
status). A pool no gateway has taken up yet shows `parents: []`; a deleted pool, none. `pool_status`
is pure.
"""

from __future__ import annotations

from typing import Any

import kopf

from pagoda_operator import kube
from pagoda_operator import render as r
from pagoda_operator.children import FIELD_MANAGER as OPERATOR
from pagoda_operator.spec import API_VERSION, KIND
from pagoda_operator.spec import GROUP as SERVICE_GROUP

FIELD_MANAGER = "pagoda-pool-status"
COPIED_CONDITIONS = ("Accepted", "ResolvedRefs")
_CONDITION_FIELDS = ("type", "status", "reason", "message", "observedGeneration", "lastTransitionTime")


def pool_status(pool: dict[str, Any]) -> dict[str, Any]:
    """status.inferencePool from the pool's status.parents."""
    parents = []
    for parent in (pool.get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        if not ref.get("name"):
            continue
        entry: dict[str, Any] = {"name": ref["name"]}
        for key in ("namespace", "kind"):
            if ref.get(key):
                entry[key] = ref[key]
        entry["conditions"] = [{k: c[k] for k in _CONDITION_FIELDS if c.get(k) is not None}
                               for c in parent.get("conditions") or [] if c.get("type") in COPIED_CONDITIONS]
        parents.append(entry)
    return {"parents": parents}


def _owner(pool: dict[str, Any]) -> str | None:
    return next((ref["name"] for ref in (pool.get("metadata") or {}).get("ownerReferences") or []
                 if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{SERVICE_GROUP}/")), None)


async def on_pool(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pool of ours changed (a gateway wrote its status): apply its parents to the owner's
    status when they differ. A deleted pool (the service left gateway mode) takes them away:
    applying nothing removes what this manager applied before."""
    pool = dict(body)
    owner = _owner(pool)
    if owner is None:
        return
    namespace = pool["metadata"].get("namespace") or "default"
    service = await kube.get(memo.kube, API_VERSION, KIND, namespace, owner)
    if service is None:
        return
    new = None if event.get("type") == "DELETED" else pool_status(pool)
    if (service.get("status") or {}).get("inferencePool") == new:
        return
    await kube.apply_status(memo.kube, namespace, owner, {} if new is None else {"inferencePool": new}, FIELD_MANAGER)


def register(registry: kopf.OperatorRegistry) -> None:
    """Watch the InferencePools the operator made (`handlers.register` does, for the operator)."""
    group, version = r.INFERENCE_POOL_API_VERSION.split("/")
    kopf.on.event(group, version, "inferencepools", registry=registry, id="inference-pool-status",
                  labels={"app.kubernetes.io/managed-by": OPERATOR})(on_pool)
