"""The operator's calls to the Kubernetes API that kopf does not make (kopf watches and posts
Events): server-side apply of children and of the status, the create-once of the internal-key
Secret, reads, prunes, the scale write (and spec.prefill.replicas'), and whether an optional CRD is served. One lightkube `AsyncClient` per operator, shared by the
reconciler and the autoscaler; `pagoda route` watches EndpointSlices with the same library.

Why lightkube, of the maintained async clients on PyPI (kr8s, kubernetes_asyncio, lightkube): it
does server-side apply (`PatchType.APPLY`, field manager, force) on any resource and on its
`Status` and `Scale` subresources, has typed models of the built-in kinds and generic resources
for CRDs, lists and watches from a resourceVersion, reads the service account or a kubeconfig,
and talks HTTP (httpx2) to any URL, kmock's emulator included; its own dependencies are few (its
models, msgspec, pyyaml, httpx2). kubernetes_asyncio covers the same through a large generated
API on aiohttp. kr8s's objects patch with merge or JSON patch only (no server-side apply) and
scale by patching spec rather than through the scale subresource.

Children stay plain dicts (`render` returns them, `conditions` reads them): this module turns a
dict into the call for its kind and a typed answer back into a dict.
"""

from __future__ import annotations

from typing import Any

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.resource_registry import resource_registry
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import CascadeType, PatchType

from pagoda_operator.spec import GROUP, KIND, PLURAL, VERSION

# The CRDs the operator reads or writes, which no client can know: (group, version, kind, plural).
# Built-in kinds come with lightkube's models.
CUSTOM_RESOURCES = [
    (GROUP, VERSION, KIND, PLURAL),
    ("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets"),
    ("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"),
    ("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"),
    ("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"),
    ("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
    ("llm-d.ai", "v1alpha2", "InferenceObjective", "inferenceobjectives"),  # read only: objectives.py
]
for _group, _version, _kind, _plural in CUSTOM_RESOURCES:
    create_namespaced_resource(_group, _version, _kind, _plural)
InferenceService = resource_registry.load(f"{GROUP}/{VERSION}", KIND)


class KubeError(Exception):
    """The API server refused a call: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def _refused(e: httpx2.HTTPStatusError) -> KubeError:
    status = getattr(e, "status", None)  # lightkube's ApiError carries the API's Status
    if status is not None and status.code:
        return KubeError(status.code, f"{status.reason or ''} {status.message or ''}".strip()[:500])
    return KubeError(e.response.status_code, e.response.text[:500])


def kind_of(api_version: str, kind: str) -> Any:
    return resource_registry.load(api_version, kind)


def as_dict(obj: Any) -> dict[str, Any]:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def connect(server: str | None = None) -> AsyncClient:
    """A client for `server` (no credentials: tests), else in a pod its service account, else
    KUBECONFIG or ~/.kube/config."""
    config = KubeConfig.from_one(cluster=Cluster(server=server), user=User()) if server else KubeConfig.from_env()
    return AsyncClient(config, timeout=httpx2.Timeout(30.0))


async def apply(client: AsyncClient, manifest: dict[str, Any], field_manager: str) -> None:
    """Server-side apply. Forced: a controller takes the fields it applies from other managers
    (https://kubernetes.io/docs/reference/using-api/server-side-apply/#using-server-side-apply-in-a-controller)."""
    meta = manifest["metadata"]
    try:
        await client.patch(kind_of(manifest["apiVersion"], manifest["kind"]), meta["name"], manifest,
                           namespace=meta.get("namespace"), patch_type=PatchType.APPLY,
                           field_manager=field_manager, force=True)
    except httpx2.HTTPStatusError as e:
        raise _refused(e) from None


async def create(client: AsyncClient, manifest: dict[str, Any], field_manager: str) -> bool:
    """Create the object unless one of its name exists: True when created, False when it was
    there already, left as it is (nothing is read, so this needs no permission to read it)."""
    obj = kind_of(manifest["apiVersion"], manifest["kind"]).from_dict(manifest)
    try:
        await client.create(obj, namespace=manifest["metadata"].get("namespace"), field_manager=field_manager)
    except httpx2.HTTPStatusError as e:
        if e.response.status_code == 409:
            return False
        raise _refused(e) from None
    return True


async def apply_status(client: AsyncClient, namespace: str, name: str, status: dict[str, Any],
                       field_manager: str) -> None:
    """Server-side apply of the fields `status` names on the InferenceService's status
    subresource, as `field_manager`: it owns exactly these afterwards, and the ones it applied
    before but leaves out now are removed. Conditions are a map list keyed on `type`, so each
    writer owns its own. An empty `status` is sent as no status at all: the manager then owns
    nothing (an empty map would make it own the status field itself, and its next apply of other
    fields would remove the whole status, every other manager's fields with it)."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name, "namespace": namespace},
            **({"status": status} if status else {})}
    try:
        await client.patch(InferenceService.Status, name, body, namespace=namespace, patch_type=PatchType.APPLY,
                           field_manager=field_manager, force=True)
    except httpx2.HTTPStatusError as e:
        raise _refused(e) from None


async def scale(client: AsyncClient, namespace: str, name: str, replicas: int, field_manager: str) -> None:
    """spec.replicas of the InferenceService through its scale subresource, as HPA and KEDA write it."""
    try:
        await client.patch(InferenceService.Scale, name, {"spec": {"replicas": replicas}}, namespace=namespace,
                           patch_type=PatchType.MERGE, field_manager=field_manager)
    except httpx2.HTTPStatusError as e:
        raise _refused(e) from None


async def set_prefill_replicas(client: AsyncClient, namespace: str, name: str, replicas: int,
                               autoscaling: dict[str, Any], field_manager: str) -> bool:
    """spec.prefill.replicas of the InferenceService (no scale subresource reaches it), by a JSON
    patch whose first operation tests that spec.prefill.autoscaling is still `autoscaling`: a
    decision made from a spec the user has since changed (or whose spec.prefill is gone, which a
    merge patch would bring back) is not written. False when that test failed."""
    patch = [{"op": "test", "path": "/spec/prefill/autoscaling", "value": autoscaling},
             {"op": "add", "path": "/spec/prefill/replicas", "value": replicas}]
    try:
        await client.patch(InferenceService, name, patch, namespace=namespace, patch_type=PatchType.JSON,
                           field_manager=field_manager)
    except httpx2.HTTPStatusError as e:
        if e.response.status_code == 422:  # the test operation failed
            return False
        raise _refused(e) from None
    return True


async def get(client: AsyncClient, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object as a dict; None when it (or its kind) does not exist."""
    try:
        return as_dict(await client.get(kind_of(api_version, kind), name, namespace=namespace))
    except httpx2.HTTPStatusError as e:
        if e.response.status_code == 404:
            return None
        raise _refused(e) from None


async def list_labelled(client: AsyncClient, api_version: str, kind: str, namespace: str,
                        labels: dict[str, str]) -> list[dict[str, Any]]:
    try:
        return [as_dict(obj) async for obj in client.list(kind_of(api_version, kind), namespace=namespace, labels=labels)]
    except httpx2.HTTPStatusError as e:
        raise _refused(e) from None


async def delete(client: AsyncClient, api_version: str, kind: str, namespace: str, name: str) -> None:
    """Delete in the background: the garbage collector removes what the object owns."""
    try:
        await client.delete(kind_of(api_version, kind), name, namespace=namespace, cascade=CascadeType.BACKGROUND)
    except httpx2.HTTPStatusError as e:
        if e.response.status_code != 404:
            raise _refused(e) from None


async def served(client: AsyncClient, api_version: str, kind: str, namespace: str) -> bool:
    """Is this kind served (its CRD installed)? Asked at each reconcile, so a CRD installed later
    is noticed without a restart: a list of at most one object, 404 when the kind is unknown."""
    try:
        async for _ in client.list(kind_of(api_version, kind), namespace=namespace, chunk_size=1):
            break
    except httpx2.HTTPStatusError as e:
        if e.response.status_code == 404:
            return False
        raise _refused(e) from None
    return True
