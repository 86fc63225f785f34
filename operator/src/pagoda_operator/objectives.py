"""The InferenceObjectives of a service's InferencePool, handed to its Endpoint Picker.

An `InferenceObjective` (llm-d.ai/v1alpha2: the llm-d router's, whose request headers
`pagoda epp` reads; GAIE's own v1alpha2 copy was removed in GAIE 1.6) names a pool by its
`poolRef` and gives the requests that name it (`x-llm-d-inference-objective: <its name>`) a
`priority` (unset: 0). With router.mode: gateway the pool is named like the InferenceService, and
the operator writes the priorities of the objectives that name it into the ConfigMap
`<name>-epp` (`render.render_epp_objectives`), which the picker reads as its
--objectives-file and re-reads when kubelet updates the mount: a changed objective reaches the
picker without a restart.

Who writes the ConfigMap: the reconcile (with every other child, so it is there before the
picker's pod starts), and this module's watch of InferenceObjectives, which applies the same
rendering for every gateway-mode service of the objective's namespace whenever an objective is
created, changed or deleted (an objective moved from one pool to another changes both). A
cluster without the CRD has no objectives: the ConfigMap is an empty object, nothing degrades.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pagoda_operator import kube
from pagoda_operator import render as r
from pagoda_operator.children import FIELD_MANAGER
from pagoda_operator.schema import SpecProblems
from pagoda_operator.spec import API_VERSION, KIND, parse_spec

GROUP, VERSION, PLURAL, OBJECTIVE_KIND = "llm-d.ai", "v1alpha2", "inferenceobjectives", "InferenceObjective"
OBJECTIVE_API_VERSION = f"{GROUP}/{VERSION}"
POOL_GROUP = "inference.networking.k8s.io"

log = logging.getLogger(__name__)


def names_pool(objective: dict[str, Any], pool: str) -> bool:
    """Whether the objective's poolRef is the InferencePool `pool` (group and kind at their
    CRD defaults when left out)."""
    ref = (objective.get("spec") or {}).get("poolRef") or {}
    return (ref.get("name") == pool and (ref.get("group") or POOL_GROUP) == POOL_GROUP
            and (ref.get("kind") or "InferencePool") == "InferencePool")


def priorities(objectives: list[dict[str, Any]], pool: str) -> dict[str, int]:
    """objective name -> priority, of the objectives whose poolRef is `pool`."""
    out = {}
    for objective in objectives:
        if names_pool(objective, pool):
            priority = (objective.get("spec") or {}).get("priority")
            out[objective["metadata"]["name"]] = priority if isinstance(priority, int) else 0
    return out


async def list_objectives(client: Any, namespace: str) -> list[dict[str, Any]]:
    """The namespace's InferenceObjectives; none while their CRD is not installed."""
    try:
        return await kube.list_labelled(client, OBJECTIVE_API_VERSION, OBJECTIVE_KIND, namespace, {})
    except kube.KubeError as e:
        if e.status == 404:
            return []
        raise


async def pool_objectives(client: Any, namespace: str, pool: str) -> dict[str, int]:
    return priorities(await list_objectives(client, namespace), pool)


def _gateway_mode(service: dict[str, Any]) -> bool:
    try:
        return parse_spec(service.get("spec")).router.mode == "gateway"
    except SpecProblems:
        return False  # an invalid service gets no children, this ConfigMap neither


async def sync_namespace(client: Any, namespace: str) -> None:
    """Apply every gateway-mode service's objectives ConfigMap in `namespace` from the objectives
    there now (server-side apply of unchanged content changes nothing)."""
    objectives = await list_objectives(client, namespace)
    for service in await kube.list_labelled(client, API_VERSION, KIND, namespace, {}):
        if _gateway_mode(service):
            name = service["metadata"]["name"]
            body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": service["metadata"]}
            await kube.apply(client, r.render_epp_objectives(body, priorities(objectives, name)), FIELD_MANAGER)


async def on_objective(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    namespace = body.get("metadata", {}).get("namespace") or "default"
    try:
        await sync_namespace(memo.kube, namespace)
    except kube.KubeError as e:
        # The next objective event or the service's next reconcile writes it again.
        log.warning("handing the InferenceObjectives of %s to the endpoint pickers failed: %s", namespace, e)


def register(registry: kopf.OperatorRegistry) -> None:
    """Watch InferenceObjectives (`handlers.register` does, for the operator). kopf finds the
    kind once its CRD is installed."""
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="inference-objectives")(on_objective)
