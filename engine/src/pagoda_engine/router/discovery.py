"""Where the backend list comes from: a static `--backends` list, or the EndpointSlices of the
engine Service (`--k8s-service NAMESPACE/NAME`) watched through the kubernetes client.

The kubernetes client is synchronous, so the watch runs in a thread and hands each new URL set to
the event loop. A slice's endpoint counts when its `ready` condition is not false; the port is the
slice port named `--backend-port-name` (default `http`), else the slice's first port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
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
    """Keeps `on_change(urls)` up to date with the Service's ready endpoints. list + watch, and
    a fresh list after any watch error (410 Gone, dropped connection) with a capped backoff."""

    def __init__(self, namespace: str, service: str, on_change: Callable[[list[str]], None],
                 loop: asyncio.AbstractEventLoop, port_name: str = "http", kubeconfig: str | None = None):
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.loop = loop
        self.port_name = port_name
        self.kubeconfig = kubeconfig
        self._slices: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)

    def _api(self):
        from kubernetes import client, config

        if self.kubeconfig:
            api_client = config.new_client_from_config(config_file=self.kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        return client.DiscoveryV1Api(api_client)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _publish(self) -> None:
        urls = sorted({u for urls in self._slices.values() for u in urls})
        self.loop.call_soon_threadsafe(self.on_change, urls)

    def _apply(self, event_type: str, obj: dict) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if labels.get(SERVICE_NAME_LABEL) != self.service:
            return  # the label selector already filters; this guards servers that ignore it
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = slice_urls(obj, self.port_name)

    def _run(self) -> None:
        from kubernetes import watch

        backoff = 0.5
        selector = f"{SERVICE_NAME_LABEL}={self.service}"
        while not self._stop.is_set():
            try:
                api = self._api()
                listing = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                             _preload_content=False)
                body = json.loads(listing.data)
                self._slices = {}
                for item in body.get("items") or []:
                    self._apply("ADDED", item)
                self._publish()
                version = (body.get("metadata") or {}).get("resourceVersion")
                self._watch = watch.Watch()
                kwargs = {"label_selector": selector, "timeout_seconds": 300}
                if version and version.isdigit():
                    kwargs["resource_version"] = version
                for event in self._watch.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                                _preload_content=False, **kwargs):
                    if self._stop.is_set():
                        return
                    obj = event.get("raw_object") or {}
                    if event.get("type") == "ERROR":
                        raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                    self._apply(event["type"], obj)
                    self._publish()
                    backoff = 0.5
            except Exception as e:  # noqa: BLE001 - any failure means: list again, after a pause
                if self._stop.is_set():
                    return
                log.warning("EndpointSlice watch for %s/%s failed (%s); relisting in %.1fs",
                            self.namespace, self.service, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
