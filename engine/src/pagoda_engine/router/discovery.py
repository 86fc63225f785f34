"""Where the backend list comes from: a static `--backends` list, or the EndpointSlices of the
engine Service (`--k8s-service NAMESPACE/NAME`), listed and watched with lightkube's async client
(the operator's Kubernetes client too) in the router's event loop.

A slice's endpoint counts when its `ready` condition is not false; the port is the slice port
named `--backend-port-name` (default `http`), else the slice's first port.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pagoda_engine.router.backends import BackendConfigError

log = logging.getLogger("pagoda.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def parse_k8s_service(value: str) -> tuple[str, str]:
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise BackendConfigError(f"--k8s-service {value!r}: expected NAMESPACE/NAME, e.g. default/llama-engine")
    return namespace, name


def slice_urls(endpoint_slice: dict, port_name: str = "http", scheme: str = "http") -> list[str]:
    """The ready endpoints of one EndpointSlice (a dict in the API's JSON shape) as base URLs."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and ports:
        port = ports[0].get("port")
    if port is None:
        return []
    urls = []
    for ep in endpoint_slice.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        for address in ep.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.append(f"{scheme}://{host}:{port}")
    return urls


class EndpointSliceWatcher:
    """Keeps `on_change(urls)` up to date with the Service's ready endpoints: a task in `loop`
    that lists, then watches from the list's resourceVersion, and lists afresh after any watch
    error (410 Gone, a dropped connection) with a capped backoff."""

    def __init__(self, namespace: str, service: str, on_change: Callable[[list[str]], None],
                 loop: asyncio.AbstractEventLoop, port_name: str = "http", kubeconfig: str | None = None):
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.loop = loop
        self.port_name = port_name
        self.kubeconfig = kubeconfig
        self._slices: dict[str, list[str]] = {}
        self._task: asyncio.Task | None = None

    def _client(self):
        from lightkube import AsyncClient, KubeConfig

        # In a pod its service account, else KUBECONFIG or ~/.kube/config; --kubeconfig wins.
        config = KubeConfig.from_file(self.kubeconfig) if self.kubeconfig else KubeConfig.from_env()
        return AsyncClient(config)

    def start(self) -> None:
        self._task = self.loop.create_task(self._run(), name="endpointslice-watch")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _publish(self) -> None:
        self.on_change(sorted({u for urls in self._slices.values() for u in urls}))

    def _apply(self, event_type: str, obj: dict) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(SERVICE_NAME_LABEL) != self.service:
            return  # the label selector already filters; this guards servers that ignore it
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = slice_urls(obj, self.port_name)

    async def _run(self) -> None:
        from lightkube.core.exceptions import NotReadyError
        from lightkube.resources.discovery_v1 import EndpointSlice

        backoff = 0.5
        selector = {SERVICE_NAME_LABEL: self.service}
        client = None
        try:
            while True:
                try:
                    client = client or self._client()
                    listing = client.list(EndpointSlice, namespace=self.namespace, labels=selector)
                    self._slices = {}
                    async for item in listing:
                        self._apply("ADDED", item.to_dict())
                    self._publish()
                    try:
                        version = listing.resourceVersion
                    except NotReadyError:  # the server gave the list no version: watch from now
                        version = None
                    async for event_type, obj in client.watch(EndpointSlice, namespace=self.namespace, labels=selector,
                                                              server_timeout=300, resource_version=version):
                        self._apply(event_type, obj.to_dict())
                        self._publish()
                        backoff = 0.5
                except Exception as e:  # noqa: BLE001 - any failure means: list again, after a pause
                    log.warning("EndpointSlice watch for %s/%s failed (%s); relisting in %.1fs",
                                self.namespace, self.service, e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            if client is not None:
                await client.close()
