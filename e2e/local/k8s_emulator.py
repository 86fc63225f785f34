"""Kubernetes for tests that run the built-in autoscaler for real: the operator tests' emulated
API server (tests/operator/apiserver.py: kmock's KubernetesEmulator extended to the documented
API server behaviour, in a background thread), a kubeconfig pointing at it, and a real kopf
operator running the autoscaler's handlers in a thread of its own (kopf cancels every task of
the loop it runs in, so it gets its own loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.operator.apiserver import BackgroundApiServer  # noqa: E402

IS_PATH = "/apis/pagoda.dev/v1alpha1/namespaces/{namespace}/inferenceservices"


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }))
    return path


class Cluster:
    """The emulated API server plus the calls the tests make on InferenceServices."""

    def __init__(self, apiserver: BackgroundApiServer, kubeconfig: Path):
        self.apiserver = apiserver
        self.url = apiserver.url
        self.kubeconfig = kubeconfig

    def create(self, body: dict) -> dict:
        ns = body["metadata"].get("namespace", "default")
        r = httpx.post(self.url + IS_PATH.format(namespace=ns), json=body)
        r.raise_for_status()
        return r.json()

    def set_status(self, name: str, status: dict, namespace: str = "default") -> None:
        """What the operator (from the engine Deployment) would write: replicas, readyReplicas."""
        r = httpx.patch(f"{self.url}{IS_PATH.format(namespace=namespace)}/{name}/status", json={"status": status},
                        headers={"content-type": "application/merge-patch+json"})
        r.raise_for_status()

    def get(self, name: str, namespace: str = "default") -> dict:
        return self.apiserver.api.get("pagoda.dev", "v1alpha1", "inferenceservices", namespace, name)

    def events(self, namespace: str = "default") -> list[dict]:
        return [self.apiserver.api.get("", "v1", "events", namespace, n)
                for n in self.apiserver.api.names("", "v1", "events", namespace)]

    def decided(self, name: str, replicas: int) -> bool:
        """The autoscaler set `replicas` and recorded it (spec.replicas, through the scale
        subresource, is written before kopf patches the status)."""
        obj = self.get(name)
        return obj["spec"].get("replicas") == replicas and obj["status"]["autoscaling"]["desiredReplicas"] == replicas

    def scaling_ready(self, name: str) -> dict | None:
        return next((c for c in (self.get(name).get("status") or {}).get("conditions") or []
                     if c["type"] == "ScalingReady"), None)

    def scale_writes(self) -> list:
        return [w for w in self.apiserver.api.writes if w.path.endswith("/scale")]


@contextlib.contextmanager
def emulated_cluster(tmp_path: Path):
    apiserver = BackgroundApiServer()
    try:
        yield Cluster(apiserver, write_kubeconfig(tmp_path / "kubeconfig.json", apiserver.url))
    finally:
        apiserver.close()


_server: dict = {"url": None}


@contextlib.contextmanager
def autoscaler_operator(url: str):
    """kopf.operator() with the autoscaler's handlers (kopf's default registry) against `url`."""
    import kopf

    import pagoda_operator.autoscaler.handlers  # noqa: F401 - registers the timer

    _server["url"] = url
    registry = kopf.get_default_registry()
    if not any(h.id == "pagoda-emulator-login" for h in registry._activities.get_all_handlers()):
        # Registered once per process (the default registry is global); reads the current server.
        @kopf.on.login(id="pagoda-emulator-login")
        def _login(**_):
            return kopf.ConnectionInfo(server=_server["url"], insecure=True, token="test-token")

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    def main():
        asyncio.set_event_loop(loop)
        holder["stop"] = asyncio.Event()
        ready.set()
        loop.run_until_complete(kopf.operator(standalone=True, clusterwide=True, stop_flag=holder["stop"]))

    thread = threading.Thread(target=main, name="kopf-autoscaler", daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(30)


def inference_service(name: str, namespace: str = "default", *, replicas: int | None = None,
                      autoscaling: dict | None = None) -> dict:
    spec: dict = {"model": {"uri": "file:///models/tiny", "name": name}}
    if replicas is not None:
        spec["replicas"] = replicas
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
