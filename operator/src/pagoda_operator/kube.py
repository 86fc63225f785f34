"""The few Kubernetes API calls the operator makes itself (kopf does the watching): server-side
apply of children, reads, the status write, and discovery of optional CRDs.

A small async client over aiohttp rather than the generated `kubernetes` client: the operator
needs five verbs on a handful of kinds, in kopf's event loop. Credentials come from the same
place as kopf's (in-cluster service account or kubeconfig, via `kubernetes.config`).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from pagoda_operator.render import FIELD_MANAGER
from pagoda_operator.spec import API_VERSION, KIND, PLURAL

# kind → plural, for every kind the operator reads or writes (all namespaced).
PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Deployment": "deployments",
    "LeaderWorkerSet": "leaderworkersets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Ingress": "ingresses",
    "ServiceMonitor": "servicemonitors",
    "ScaledObject": "scaledobjects",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    KIND: PLURAL,
}


class ApiError(Exception):
    """A non-2xx answer from the API server, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{PLURALS[kind]}" + (f"/{name}" if name else "")


@dataclass
class Credentials:
    """Where the API server is and how to authenticate to it."""

    server: str
    authorization: Callable[[], str | None] = lambda: None  # re-evaluated per request (token rotation)
    ssl_context: ssl.SSLContext | bool = True


def credentials_from_kubernetes_config() -> Credentials:
    """In a pod: its service account; elsewhere: the current kubeconfig context."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)
    context: ssl.SSLContext | bool
    if cfg.verify_ssl:
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
    else:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cfg.cert_file:
        context.load_cert_chain(cfg.cert_file, cfg.key_file)
    return Credentials(
        server=cfg.host,
        # Calls the loader's refresh hook, so projected service-account tokens and exec plugins
        # stay current.
        authorization=lambda: cfg.get_api_key_with_prefix("BearerToken"),
        ssl_context=context,
    )


class KubeClient:
    def __init__(self, credentials: Credentials | None = None, *, server: str | None = None):
        if credentials is None:
            credentials = Credentials(server=server) if server else credentials_from_kubernetes_config()
        self.credentials = credentials
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        if self._session is None:  # created in the loop that uses it (kopf's)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        headers = {"Accept": "application/json"}
        auth = self.credentials.authorization()
        if auth:
            headers["Authorization"] = auth
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)  # JSON is valid YAML: the apply-patch+yaml body too
        url = self.credentials.server.rstrip("/") + path
        async with self._session.request(method, url, data=data, params=params, headers=headers,
                                         ssl=self.credentials.ssl_context) as response:
            text = await response.text()
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text}
            if response.status >= 400:
                raise ApiError(response.status, str(payload.get("reason") or response.reason),
                               str(payload.get("message") or text)[:500])
            return payload

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager; force takes fields from other managers
        (the operator is the only intended writer of its children)."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        return await self.request("PATCH", path, body=manifest, params={"fieldManager": FIELD_MANAGER, "force": "true"},
                                  content_type="application/apply-patch+yaml")

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        listing = await self.request("GET", resource_path(api_version, kind, namespace), params={"labelSelector": label_selector})
        return listing.get("items") or []

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete in the background: the garbage collector removes what the object owns."""
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name),
                               params={"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
        """Merge-patch the InferenceService's status. With resource_version, a concurrent write in
        between fails with 409 instead of being overwritten."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        path = resource_path(API_VERSION, KIND, namespace, name) + "/status"
        return await self.request("PATCH", path, body=body, params={"fieldManager": FIELD_MANAGER},
                                  content_type="application/merge-patch+json")

    async def has_kind(self, api_version: str, kind: str) -> bool:
        """Is this kind served (its CRD installed)? Asked at each reconcile, so a CRD installed
        later is noticed without a restart."""
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            listing = await self.request("GET", base)
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("kind") == kind and "/" not in r.get("name", "") for r in listing.get("resources", []))
