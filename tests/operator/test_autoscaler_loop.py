"""The built-in autoscaler end to end with real parts and small engines: engine doubles
(e2e/local/fake_engine.py, real HTTP, a settable queue) and `pagoda route` scraped by a real
Prometheus; the autoscaler's kopf timer in a real kopf operator against kmock's Kubernetes
emulator, scaling the InferenceService through its scale subresource."""

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))

from k8s_emulator import IS_RESOURCE, autoscaler_operator, emulated_cluster, inference_service  # noqa: E402
from pagoda_e2e import (PROMETHEUS, PYTHON, Proc, free_port, prometheus_config, start_prometheus,  # noqa: E402
                        start_router)

from pagoda_operator.autoscaler.prometheus import PrometheusClient, queries  # noqa: E402

FAKE = str(Path(__file__).resolve().parents[2] / "e2e" / "local" / "fake_engine.py")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)")


def start_fake(tmp: Path, port: int, name: str) -> Proc:
    proc = Proc([PYTHON, FAKE, "--port", str(port), "--model", "tiny"], tmp / f"{name}.log")
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
    return proc


async def until(predicate, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Two engines (one not started: the replica the scaler brings up), a router, Prometheus."""
    tmp = tmp_path_factory.mktemp("autoscale")
    p_engine, p_late, p_router, p_prom = free_port(), free_port(), free_port(), free_port()
    engine = start_fake(tmp, p_engine, "engine")
    config = prometheus_config({
        "engines": [(f"127.0.0.1:{p_engine}", {"namespace": "default", "service": "svc-engine"}),
                    (f"127.0.0.1:{p_late}", {"namespace": "default", "service": "zero-engine"})],
        "router": [(f"127.0.0.1:{p_router}", {"namespace": "default", "service": "zero"})],
    }, interval_s=1.0)
    prom = start_prometheus(p_prom, config, tmp / "prometheus")
    router = start_router(p_router, [f"http://127.0.0.1:{p_late}"], tmp / "router.log",
                          ["--queue-timeout", "120", "--health-interval", "0.5"])
    yield {"tmp": tmp, "engine": f"http://127.0.0.1:{p_engine}", "late_port": p_late,
           "router": f"http://127.0.0.1:{p_router}", "prom": f"http://127.0.0.1:{p_prom}", "prom_proc": prom}
    for p in (router, prom, engine):
        p.stop()


async def test_prometheus_client_reads_the_policy_metrics_and_tells_absent_from_zero(stack):
    httpx.post(stack["engine"] + "/admin", json={"waiting": 5, "running": 3})
    client = PrometheusClient(stack["prom"])
    obs = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        obs = await client.observe("kvUtilization", "default", "svc", current_replicas=1, ready_replicas=1)
        if obs.waiting == 5:
            break
        await asyncio.sleep(0.3)
    assert obs.error is None and (obs.waiting, obs.running) == (5, 3)
    assert obs.kv_usage == pytest.approx(0.3)
    assert obs.router_held is None  # no router scraped for this service: absent, not zero
    assert await client.query(queries("queue", "default", "nothing")["waiting"]) is None
    bad = await PrometheusClient(f"http://127.0.0.1:{free_port()}").observe("queue", "default", "svc", 1, 1)
    assert bad.error and "unreachable" in bad.error
    httpx.post(stack["engine"] + "/admin", json={"waiting": 0, "running": 0})


async def prometheus_sees_waiting(stack, value: float) -> None:
    client, promql = PrometheusClient(stack["prom"]), queries("queue", "default", "svc")["waiting"]
    deadline = time.monotonic() + 20
    while await client.query(promql) != value:
        assert time.monotonic() < deadline, f"Prometheus never saw waiting = {value}"
        await asyncio.sleep(0.2)


async def test_queue_scales_up_then_down_after_the_delay_with_status_and_events(stack, tmp_path, monkeypatch):
    httpx.post(stack["engine"] + "/admin", json={"waiting": 0})
    await prometheus_sees_waiting(stack, 0)
    async with emulated_cluster(tmp_path) as (k8s, url, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        key = (IS_RESOURCE, "default", "svc")
        k8s.objects[key] = inference_service("svc", replicas=1, ready=1, autoscaling={
            "minReplicas": 1, "maxReplicas": 4, "policy": "queue", "target": 2, "scaleUpDelay": "0s",
            "scaleDownDelay": "3s", "intervalSeconds": 1, "prometheusURL": stack["prom"]})
        obj = lambda: k8s.objects[key].raw  # noqa: E731
        async with autoscaler_operator(url):
            await until(lambda: (obj().get("status") or {}).get("autoscaling"), 20, "a first decision")
            assert obj()["spec"]["replicas"] == 1
            httpx.post(stack["engine"] + "/admin", json={"waiting": 6})
            # spec.replicas (scale subresource) is written before kopf patches the status
            await until(lambda: obj()["spec"]["replicas"] == 3 and obj()["status"]["autoscaling"]["desiredReplicas"] == 3,
                        20, "scale up to ceil(6/2) = 3")
            up = obj()["status"]["autoscaling"]
            assert up["lastDecision"]["result"] == 3 and up["lastDecision"]["inputs"]["waiting"] == 6
            assert "ceil(6/2) = 3" in up["lastDecision"]["reason"]
            ready = [c for c in obj()["status"]["conditions"] if c["type"] == "ScalingReady"]
            assert ready and ready[0]["status"] == "True"

            httpx.post(stack["engine"] + "/admin", json={"waiting": 0})
            quiet_since = time.monotonic()
            await until(lambda: obj()["spec"]["replicas"] == 2 and obj()["status"]["autoscaling"]["desiredReplicas"] == 2,
                        20, "one step down")
            assert time.monotonic() - quiet_since >= 3 - 0.5  # not before scaleDownDelay
            assert "scaleDownDelay" in obj()["status"]["autoscaling"]["lastDecision"]["reason"]

            events = await until(lambda: [o.raw for (res, _, _), o in k8s.objects.items()
                                          if res.plural == "events" and not o.deleted], 10, "events")
            reasons = {e.get("reason") for e in events}
            assert {"ScaledUp", "ScaledDown"} <= reasons
            scale_writes = [r for r in k8s if r.subresource == "scale"]
            assert scale_writes and scale_writes[-1].data == {"spec": {"replicas": 2}}


async def test_held_request_scales_from_zero_and_is_served_when_the_replica_comes_up(stack, tmp_path, monkeypatch):
    async with emulated_cluster(tmp_path) as (k8s, url, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        key = (IS_RESOURCE, "default", "zero")
        k8s.objects[key] = inference_service("zero", replicas=0, ready=0, autoscaling={
            "minReplicas": 0, "maxReplicas": 2, "policy": "queue", "scaleDownDelay": "60s",
            "intervalSeconds": 1, "prometheusURL": stack["prom"]})
        obj = lambda: k8s.objects[key].raw  # noqa: E731
        async with autoscaler_operator(url):
            await until(lambda: (obj().get("status") or {}).get("autoscaling"), 20, "a first decision")
            assert obj()["spec"]["replicas"] == 0  # idle at zero stays at zero
            held = asyncio.create_task(asyncio.to_thread(
                httpx.post, stack["router"] + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                timeout=120))
            await until(lambda: obj()["spec"]["replicas"] == 1 and obj()["status"]["autoscaling"]["desiredReplicas"] == 1,
                        30, "scale from zero")
            decision = obj()["status"]["autoscaling"]["lastDecision"]
            assert decision["inputs"]["routerHeld"] >= 1 and "scale from zero" in decision["reason"]
            assert not held.done()
            # Kubernetes would now start a pod; here the test does
            engine = start_fake(stack["tmp"], stack["late_port"], "late")
            try:
                response = await asyncio.wait_for(held, 60)
                assert response.status_code == 200 and response.json()["choices"][0]["text"] == "t0 t1 "
            finally:
                engine.stop()


async def test_prometheus_down_sets_scaling_ready_false_and_keeps_replicas(stack, tmp_path, monkeypatch):
    async with emulated_cluster(tmp_path) as (k8s, url, kubeconfig):
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        key = (IS_RESOURCE, "default", "svc")
        k8s.objects[key] = inference_service("svc", replicas=2, ready=2, autoscaling={
            "minReplicas": 1, "maxReplicas": 4, "scaleDownDelay": "600s", "intervalSeconds": 1,
            "prometheusURL": stack["prom"]})
        obj = lambda: k8s.objects[key].raw  # noqa: E731
        cond = lambda: next((c for c in (obj().get("status") or {}).get("conditions") or []  # noqa: E731
                             if c["type"] == "ScalingReady"), None)
        async with autoscaler_operator(url):
            await until(lambda: cond() and cond()["status"] == "True", 20, "ScalingReady=True")
            stack["prom_proc"].stop()
            await until(lambda: cond()["status"] == "False", 20, "ScalingReady=False")
            assert cond()["reason"] == "PrometheusUnavailable" and "unreachable" in cond()["message"]
            await asyncio.sleep(2)
            assert obj()["spec"]["replicas"] == 2
