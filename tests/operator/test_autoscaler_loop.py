"""The built-in autoscaler end to end with real parts and small engines: engine doubles
(e2e/local/fake_engine.py, real HTTP, a settable queue) and `pagoda route`, scraped by a real
Prometheus; the autoscaler's kopf timer in a real kopf operator against the emulated API server,
scaling the InferenceService through its scale subresource."""

import asyncio
import concurrent.futures
import sys
import time
from pathlib import Path

import httpx
import kopf
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))

from k8s_emulator import autoscaler_operator, emulated_cluster, inference_service  # noqa: E402
from pagoda_e2e import (PROMETHEUS, PYTHON, Proc, free_port, prometheus_config, start_prometheus,  # noqa: E402
                        start_router, until)

from pagoda_operator import kube  # noqa: E402
from pagoda_operator.autoscaler import handlers  # noqa: E402
from pagoda_operator.autoscaler.prometheus import PrometheusClient, queries  # noqa: E402

FAKE = str(Path(__file__).resolve().parents[2] / "e2e" / "local" / "fake_engine.py")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)")


def start_fake(tmp: Path, port: int, name: str) -> Proc:
    proc = Proc([PYTHON, FAKE, "--port", str(port), "--model", "tiny"], tmp / f"{name}.log")
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
    return proc


def query(prom: str, promql: str):
    return asyncio.run(PrometheusClient(prom).query(promql))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """An engine, a router whose only engine is not started yet, and Prometheus scraping both."""
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
                          ["--queue-timeout", "300", "--health-interval", "0.5"])
    yield {"tmp": tmp, "engine": f"http://127.0.0.1:{p_engine}", "late_port": p_late,
           "router": f"http://127.0.0.1:{p_router}", "prom": f"http://127.0.0.1:{p_prom}", "prom_proc": prom}
    for p in (router, prom, engine):
        p.stop()


def set_waiting(stack, value: int) -> None:
    """Make the engine report a queue, and wait until Prometheus has scraped it."""
    httpx.post(stack["engine"] + "/admin", json={"waiting": value})
    until(lambda: query(stack["prom"], queries("queue", "default", "svc")["waiting"]) == value, 60,
          f"Prometheus to see waiting = {value}")


def test_prometheus_client_reads_the_policy_metrics_and_tells_absent_from_zero(stack):
    httpx.post(stack["engine"] + "/admin", json={"waiting": 5, "running": 3})
    client = PrometheusClient(stack["prom"])
    obs = until(lambda: (o := asyncio.run(client.observe("kvUtilization", "default", "svc", 1, 1))).waiting == 5 and o,
                60, "Prometheus to scrape the queue")
    assert obs.error is None and (obs.waiting, obs.running) == (5, 3)
    assert obs.kv_usage == pytest.approx(0.3)
    assert obs.router_held is None  # no router scraped for this service: absent, not zero
    assert query(stack["prom"], queries("queue", "default", "nothing")["waiting"]) is None
    bad = asyncio.run(PrometheusClient(f"http://127.0.0.1:{free_port()}").observe("queue", "default", "svc", 1, 1))
    assert bad.error and "unreachable" in bad.error
    httpx.post(stack["engine"] + "/admin", json={"running": 0})
    set_waiting(stack, 0)


# Several decision intervals (1 s) and Prometheus scrapes (1 s) long, so "not before the delay"
# is unambiguous even when a loaded machine spaces decisions out.
DOWN_DELAY_S = 5


def test_queue_scales_up_at_once_then_down_one_step_per_delay(stack, tmp_path):
    set_waiting(stack, 0)
    with emulated_cluster(tmp_path) as cluster, autoscaler_operator(cluster.url):
        cluster.create(inference_service("svc", replicas=2, autoscaling={
            "minReplicas": 2, "maxReplicas": 5, "policy": "queue", "target": 2, "scaleUpDelay": "0s",
            "scaleDownDelay": f"{DOWN_DELAY_S}s", "intervalSeconds": 1, "prometheusURL": stack["prom"]}))
        cluster.set_status("svc", {"replicas": 2, "readyReplicas": 2})
        with cluster.recording_decisions("svc") as log:
            until(lambda: log.first(lambda d: d["result"] == 2), 60, "a first decision")
            set_waiting(stack, 8)
            up = until(lambda: log.first(lambda d: d["result"] == 4), 60, "scale up to ceil(8/2) = 4")
            until(lambda: cluster.decided("svc", 4), 30, "spec.replicas = 4")
            assert up["inputs"]["waiting"] == 8 and "ceil(8/2) = 4" in up["reason"]
            # scaleUpDelay 0: the first decision that saw the queue scaled
            assert up is log.first(lambda d: d["inputs"].get("waiting") == 8)
            assert cluster.scaling_ready("svc")["status"] == "True"

            set_waiting(stack, 0)
            # an empty queue steps down one replica at a time, each step after scaleDownDelay
            down = until(lambda: log.first(lambda d: d["result"] == 3), DOWN_DELAY_S + 60, "one step down")
            assert down["recommendation"] == 3 and "no request waiting" in down["reason"]
            assert "scaleDownDelay" in down["reason"]
            log.assert_after_delay(down, DOWN_DELAY_S)
            floor = until(lambda: log.first(lambda d: d["result"] == 2 and d["inputs"]["currentReplicas"] == 3),
                          DOWN_DELAY_S + 60, "a second step down, to minReplicas")
            until(lambda: cluster.decided("svc", 2), 30, "spec.replicas = 2")
            log.assert_after_delay(floor, DOWN_DELAY_S)
            # minReplicas holds: later decisions keep 2
            until(lambda: len([d for d in log.decisions() if d["time"] > floor["time"]]) >= 3, 60,
                  "three more decisions")
        assert all(d["result"] == 2 for d in log.decisions() if d["time"] > floor["time"])
        assert cluster.get("svc")["spec"]["replicas"] == 2

        # one Event per scaling, each with the counts (3 only lasted scaleDownDelay: read it here)
        until(lambda: sorted((e["reason"], e["message"].split(" replicas")[0]) for e in cluster.events()
                             if e["reason"].startswith("Scaled"))
              == [("ScaledDown", "3 -> 2"), ("ScaledDown", "4 -> 3"), ("ScaledUp", "2 -> 4")], 30, "the scaling Events")
        # exactly three scalings, 2 -> 4 -> 3 -> 2, and no repeated write of a count already set
        assert [w.changed for w in cluster.scale_writes()] == [True, True, True]


def test_a_stale_body_after_a_scale_write_neither_rescales_nor_repeats_the_event(stack, tmp_path, monkeypatch):
    """kopf hands the timer the body its watch last delivered: right after a scale write (late
    on a loaded machine) that still holds the old spec.replicas. The timer decides from the
    replicas it set until the write shows up, so it neither writes them again nor posts a
    second ScaledUp Event with the wrong "before"."""
    events = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: events.append(kw))
    with emulated_cluster(tmp_path) as cluster:
        cluster.create(inference_service("svc", replicas=2, autoscaling={
            "minReplicas": 2, "maxReplicas": 5, "policy": "queue", "target": 2, "scaleDownDelay": "600s",
            "intervalSeconds": 1, "prometheusURL": stack["prom"]}))
        cluster.set_status("svc", {"replicas": 2, "readyReplicas": 2})
        memo = kopf.Memo()

        async def tick_in_a_loop(body: dict) -> None:
            memo.kube = kube.connect(cluster.url)  # a client per event loop (asyncio.run makes one each)
            try:
                await handlers.autoscale(body=body, spec=body["spec"], memo=memo)
            finally:
                await memo.kube.close()

        def tick(body: dict) -> dict:
            asyncio.run(tick_in_a_loop(body))
            memo["pagoda_autoscaler"]["last"] = 0.0  # the next tick decides at once
            return cluster.get("svc")["status"]["autoscaling"]["lastDecision"]

        set_waiting(stack, 8)
        try:
            stale = cluster.get("svc")
            first = tick(stale)
            assert (first["inputs"]["currentReplicas"], first["result"]) == (2, 4)
            assert cluster.get("svc")["spec"]["replicas"] == 4
            second = tick(stale)  # the watch has not delivered the scale write yet
            assert (second["inputs"]["currentReplicas"], second["result"]) == (4, 4)
            fresh = cluster.get("svc")
            assert fresh["metadata"]["generation"] > stale["metadata"]["generation"]
            third = tick(fresh)
            assert (third["inputs"]["currentReplicas"], third["result"]) == (4, 4)
        finally:
            set_waiting(stack, 0)
        assert [w.changed for w in cluster.scale_writes()] == [True]
        scaling = [e for e in events if e["reason"].startswith("Scaled")]  # not ScalingReady's first report
        assert [e["reason"] for e in scaling] == ["ScaledUp"] and scaling[0]["message"].startswith("2 -> 4 replicas")


def test_held_request_scales_from_zero_and_is_served_when_the_replica_comes_up(stack, tmp_path):
    with emulated_cluster(tmp_path) as cluster, autoscaler_operator(cluster.url):
        cluster.create(inference_service("zero", replicas=0, autoscaling={
            "minReplicas": 0, "maxReplicas": 2, "policy": "queue", "scaleDownDelay": "60s",
            "intervalSeconds": 1, "prometheusURL": stack["prom"]}))
        until(lambda: cluster.decided("zero", 0), 60, "a first decision")  # idle at zero stays at zero
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, stack["router"] + "/v1/completions",
                               json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=300)
            until(lambda: cluster.decided("zero", 1), 60, "scale from zero")
            decision = cluster.get("zero")["status"]["autoscaling"]["lastDecision"]
            assert decision["inputs"]["routerHeld"] >= 1 and "scale from zero" in decision["reason"]
            assert not held.done()
            engine = start_fake(stack["tmp"], stack["late_port"], "late")  # what Kubernetes would now start
            try:
                response = held.result(300)
                assert response.status_code == 200 and response.json()["choices"][0]["text"] == "t0 t1 "
            finally:
                engine.stop()


def test_prometheus_down_sets_scaling_ready_false_and_keeps_replicas(stack, tmp_path):
    with emulated_cluster(tmp_path) as cluster, autoscaler_operator(cluster.url):
        cluster.create(inference_service("svc", replicas=2, autoscaling={
            "minReplicas": 1, "maxReplicas": 4, "scaleDownDelay": "600s", "intervalSeconds": 1,
            "prometheusURL": stack["prom"]}))
        cluster.set_status("svc", {"replicas": 2, "readyReplicas": 2})
        until(lambda: cluster.scaling_ready("svc")["status"] == "True", 60, "ScalingReady=True")
        stack["prom_proc"].stop()
        until(lambda: cluster.scaling_ready("svc")["status"] == "False", 60, "ScalingReady=False")
        cond = cluster.scaling_ready("svc")
        assert cond["reason"] == "PrometheusUnavailable" and "unreachable" in cond["message"]
        time.sleep(2)
        assert cluster.get("svc")["spec"]["replicas"] == 2 and not cluster.scale_writes()
