"""A Kubernetes API on 127.0.0.1 for tests that run Pagoda's operator code for real: kmock's
`KubernetesEmulator`, extended where kopf and the kubernetes client rely on documented API server
behaviour the emulator leaves out, plus a kubeconfig pointing at it and the built-in autoscaler
running under a real kopf operator.

Extensions (each is what the real API server does):
  - `metadata.generateName` on create gets a unique name (kopf posts Events that way);
  - objects carry a `metadata.resourceVersion` (kopf's finalizer JSON patch tests it).
Known gap: GET /api/v1/namespaces does not parse in kmock 0.8, so kopf runs cluster-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from pathlib import Path

import kmock

IS_RESOURCE = "pagoda.dev/v1alpha1/inferenceservices"


class Emulator(kmock.KubernetesEmulator):
    _names = itertools.count(1)

    async def _handle(self, request):
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{next(self._names):05d}"
            meta.setdefault("resourceVersion", "1")
        return await super()._handle(request)


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }))
    return path


@contextlib.asynccontextmanager
async def emulated_cluster(tmp_path: Path):
    """(emulator, base URL, kubeconfig path) with the resources Pagoda's parts use declared."""
    async with Emulator() as k, kmock.Server(k) as server:
        url = str(server.url).rstrip("/")
        verbs = ["get", "list", "watch", "create", "update", "patch", "delete"]
        k.resources[IS_RESOURCE] = kmock.ResourceInfo(kind="InferenceService", namespaced=True,
                                                      subresources=["status", "scale"], verbs=verbs)
        k.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(kind="EndpointSlice", namespaced=True,
                                                                              verbs=verbs)
        k.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=verbs)
        # kopf's startup waits for these two to be discoverable
        k.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
        k.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs=verbs)
        yield k, url, write_kubeconfig(tmp_path / "kubeconfig.json", url)


_server: dict = {"url": None}


@contextlib.asynccontextmanager
async def autoscaler_operator(url: str):
    """The built-in autoscaler's kopf handlers in a real kopf operator against `url`."""
    import kopf

    import pagoda_operator.autoscaler.handlers  # noqa: F401 - registers the timer

    _server["url"] = url
    registry = kopf.get_default_registry()
    if not any(h.id == "pagoda-emulator-login" for h in registry._activities.get_all_handlers()):
        # Registered once per process (kopf's registry is global); reads the current emulator.
        @kopf.on.login(id="pagoda-emulator-login")
        def _login(**_):
            return kopf.ConnectionInfo(server=_server["url"], insecure=True, token="test-token")

    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, stop_flag=stop))
    try:
        yield task
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()


def inference_service(name: str, namespace: str = "default", *, replicas: int | None = None,
                      ready: int = 0, autoscaling: dict | None = None) -> dict:
    spec: dict = {"model": {"uri": "file:///models/tiny", "name": name}}
    if replicas is not None:
        spec["replicas"] = replicas
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace, "generation": 1, "uid": f"uid-{name}",
                         "resourceVersion": "1"},
            "spec": spec, "status": {"replicas": replicas or 0, "readyReplicas": ready}}
