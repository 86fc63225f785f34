"""`pagoda route --k8s-service`: replicas come and go with the engine Service's EndpointSlices,
listed and watched with lightkube, against the operator tests' emulated API server."""

from pathlib import Path

import httpx
import pytest

from k8s_emulator import emulated_cluster
from pagoda_e2e import PYTHON, Proc, free_port, until

FAKE = str(Path(__file__).resolve().parents[2] / "e2e" / "local" / "fake_engine.py")
SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def endpoint_slice(name: str, service: str, port: int, ready: bool = True) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}]}


def backends(router: str) -> list[str]:
    return sorted(b["url"] for b in httpx.get(router + "/router/backends").json()["backends"])


@pytest.fixture
def engines(tmp_path):
    procs, ports = [], []
    for i in range(2):
        port = free_port()
        proc = Proc([PYTHON, FAKE, "--port", str(port), "--model", "tiny"], tmp_path / f"engine{i}.log")
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
        procs.append(proc)
        ports.append(port)
    yield ports
    for p in procs:
        p.stop()


def test_replicas_follow_the_services_endpointslices(engines, tmp_path):
    p_a, p_b = engines
    url_a, url_b = f"http://127.0.0.1:{p_a}", f"http://127.0.0.1:{p_b}"
    with emulated_cluster(tmp_path) as cluster:
        cluster.apiserver.api.declare("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
        api = cluster.url + SLICES
        httpx.post(api, json=endpoint_slice("tiny-engine-a", "tiny-engine", p_a)).raise_for_status()
        httpx.post(api, json=endpoint_slice("other-engine-x", "other-engine", p_b)).raise_for_status()
        port = free_port()
        router = Proc([PYTHON, "-m", "pagoda_engine.router.app", "--host", "127.0.0.1", "--port", str(port),
                       "--k8s-service", "default/tiny-engine", "--kubeconfig", str(cluster.kubeconfig),
                       "--policy", "round-robin", "--health-interval", "0.5"], tmp_path / "router.log")
        base = f"http://127.0.0.1:{port}"
        try:
            router.wait_http(base + "/health")
            until(lambda: backends(base) == [url_a], 20, "the listed slice (and not the other service's)")
            body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
            assert httpx.post(base + "/v1/completions", json=body).headers["x-pagoda-backend"] == url_a

            # a replica appears: a new slice arrives through the watch
            httpx.post(api, json=endpoint_slice("tiny-engine-b", "tiny-engine", p_b)).raise_for_status()
            until(lambda: backends(base) == sorted([url_a, url_b]), 20, "the watched slice")
            until(lambda: httpx.get(base + "/health").json()["ready_backends"] == 2, 10, "b to pass /health")
            served = {httpx.post(base + "/v1/completions", json=body).headers["x-pagoda-backend"] for _ in range(4)}
            assert served == {url_a, url_b}

            # a replica stops being ready: its endpoint turns ready=false
            httpx.patch(f"{api}/tiny-engine-a", json={"endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": False}}]},
                        headers={"content-type": "application/merge-patch+json"}).raise_for_status()
            until(lambda: backends(base) == [url_b], 20, "a to leave")
            assert {httpx.post(base + "/v1/completions", json=body).headers["x-pagoda-backend"] for _ in range(3)} == {url_b}

            # the last one goes: nothing left, requests are held (then time out) instead of failing at once
            httpx.delete(f"{api}/tiny-engine-b").raise_for_status()
            until(lambda: backends(base) == [], 20, "b to leave")
        finally:
            router.stop()
