"""What every child of an InferenceService carries, whoever renders it (`render` for the engine,
router and monitoring objects, `autoscaler.scaledobjects` for the KEDA/HPA ones): its metadata
(name, namespace, labels, the owner reference that lets the garbage collector remove it with its
owner) and the field manager that applies it. Pure; imports nothing of the operator but `spec`.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.spec import API_VERSION, KIND

FIELD_MANAGER = "pagoda-operator"  # children and the reconciler's part of the status


def selector_labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagoda",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }


def labels(name: str, component: str) -> dict[str, str]:
    return {**selector_labels(name, component), "app.kubernetes.io/managed-by": FIELD_MANAGER}


def owner_references(body: dict[str, Any]) -> list[dict[str, Any]]:
    meta = body.get("metadata") or {}
    if not meta.get("uid"):
        return []  # a file rendered before the object exists has no uid to point at
    return [{
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }]


def child_metadata(body: dict[str, Any], name: str, component: str) -> dict[str, Any]:
    """metadata of the child `name` of the InferenceService `body`."""
    meta = body["metadata"]
    out = {
        "name": name,
        "namespace": meta.get("namespace") or "default",
        "labels": labels(meta["name"], component),
    }
    refs = owner_references(body)
    if refs:
        out["ownerReferences"] = refs
    return out
