"""spec.prefill.autoscaling end to end with real parts: two engine doubles (e2e/local/fake_engine.py,
real HTTP, a settable queue) standing for a disaggregated service's prefill and decode pods, scraped
by a real Prometheus under their Services' labels (<name>-prefill, <name>-decode), and the whole
operator (reconciler and autoscaler, in kopf) against the emulated API server: the prefill
Deployment follows the prefill pods' queue, up at once and down one step per scaleDownDelay, while
the decode pods' autoscaler, deciding on its own History from the decode pods' metrics, keeps them;
without spec.prefill.autoscaling its part of the status goes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))

from k8s_emulator import DecisionLog, decision_time  # noqa: E402
from pagoda_e2e import PROMETHEUS, PYTHON, Proc, free_port, prometheus_config, start_prometheus, until  # noqa: E402

from pagoda_operator.autoscaler.prometheus import PrometheusClient, queries  # noqa: E402
from tests.operator.apiserver import BackgroundApiServer  # noqa: E402
from tests.operator.support import load_example  # noqa: E402
from tests.operator.test_operator_kmock import (DEPLOYMENTS, IS, NS, Operator, conditions, create, events_for,  # noqa: E402
                                                get, patch_spec, status_of)

FAKE = str(Path(__file__).resolve().parents[2] / "e2e" / "local" / "fake_engine.py")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)")
NAME = "pd"
# Several decision intervals (1 s) and Prometheus scrapes (1 s) long, so "not before the delay"
# is unambiguous even when a loaded machine spaces decisions out.
DOWN_DELAY_S = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefill-autoscale")
    ports = {role: free_port() for role in ("prefill", "decode")}
    engines = {}
    for role, port in ports.items():
        engines[role] = Proc([PYTHON, FAKE, "--port", str(port), "--model", "tiny"], tmp / f"{role}.log")
        engines[role].wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
    config = prometheus_config({"engines": [(f"127.0.0.1:{port}", {"namespace": NS, "service": f"{NAME}-{role}"})
                                            for role, port in ports.items()]}, interval_s=1.0)
    p_prom = free_port()
    prom = start_prometheus(p_prom, config, tmp / "prometheus")
    apiserver = BackgroundApiServer()
    operator = Operator(apiserver)
    operator.start()
    yield {"engines": {role: f"http://127.0.0.1:{port}" for role, port in ports.items()},
           "prom": f"http://127.0.0.1:{p_prom}", "apiserver": apiserver}
    operator.stop()
    apiserver.close()
    for proc in (prom, *engines.values()):
        proc.stop()


def set_waiting(stack, role: str, value: int) -> None:
    """Make one role's engine report a queue, and wait until Prometheus has scraped it."""
    httpx.post(stack["engines"][role] + "/admin", json={"waiting": value})
    promql = queries("queue", NS, NAME, role=role)["waiting"]
    until(lambda: asyncio.run(PrometheusClient(stack["prom"]).query(promql)) == value, 60,
          f"Prometheus to see the {role} pods' waiting = {value}")


class PrefillDecisions(DecisionLog):
    """DecisionLog of status.prefillAutoscaling.lastDecision."""

    def run(self) -> None:
        while not self._done.wait(0.05):
            d = (status_of(self.cluster, self.name_).get("prefillAutoscaling") or {}).get("lastDecision")
            if d:
                with self._lock:
                    self._seen.setdefault(d["time"], d)


def deployment_replicas(apiserver, role: str) -> int | None:
    return ((get(apiserver, DEPLOYMENTS, f"{NAME}-{role}") or {}).get("spec") or {}).get("replicas")


def test_the_prefill_pods_scale_on_their_queue_while_the_decode_pods_keep_theirs(stack):
    apiserver = stack["apiserver"]
    set_waiting(stack, "prefill", 0)
    set_waiting(stack, "decode", 0)
    body = load_example("tiny-disagg-autoscaling.yaml")
    body["metadata"] = {"name": NAME, "namespace": NS}
    # The example's decode pods on the queue, so the fake engine's figures decide them; its
    # delays and intervals short.
    body["spec"]["autoscaling"].update({"minReplicas": 2, "policy": "queue", "target": 2, "scaleDownDelay": "600s",
                                        "intervalSeconds": 1, "prometheusURL": stack["prom"]})
    # prometheusURL: spec.autoscaling's
    body["spec"]["prefill"]["autoscaling"].update({"scaleUpDelay": "0s", "scaleDownDelay": f"{DOWN_DELAY_S}s",
                                                   "intervalSeconds": 1})
    assert {k: body["spec"]["prefill"]["autoscaling"][k] for k in ("minReplicas", "maxReplicas", "policy", "target")} \
        == {"minReplicas": 1, "maxReplicas": 3, "policy": "queue", "target": 2}
    create(apiserver, body)
    until(lambda: deployment_replicas(apiserver, "prefill") == 1 and deployment_replicas(apiserver, "decode") == 2, 60,
          "each role's Deployment at its minReplicas")
    log = PrefillDecisions(apiserver, NAME, NS)
    log.start()
    try:
        first = until(lambda: log.first(lambda d: d["result"] == 1), 60, "a first prefill decision")
        assert "routerHeld" not in first["inputs"]  # the router's held requests are the decode pods' demand
        until(lambda: conditions(get(apiserver, IS, NAME)).get("PrefillScalingReady", {}).get("status") == "True", 30,
              "PrefillScalingReady=True")

        set_waiting(stack, "prefill", 6)
        up = until(lambda: log.first(lambda d: d["result"] == 3), 60, "the prefill pods scaled to ceil(6/2) = 3")
        assert up["inputs"]["waiting"] == 6 and "ceil(6/2) = 3" in up["reason"]
        assert up is log.first(lambda d: d["inputs"].get("waiting") == 6)  # scaleUpDelay 0: at once
        until(lambda: deployment_replicas(apiserver, "prefill") == 3, 60, "the prefill Deployment at 3 replicas")
        obj = get(apiserver, IS, NAME)
        assert obj["spec"]["prefill"]["replicas"] == 3 and obj["status"]["prefillAutoscaling"]["desiredReplicas"] == 3
        # The autoscaler's write is its own (managedFields), so the spec stays valid.
        owners = [e["manager"] for e in obj["metadata"]["managedFields"]
                  if "f:replicas" in ((e["fieldsV1"].get("f:spec") or {}).get("f:prefill") or {})]
        assert owners == ["pagoda-autoscaler"]
        until(lambda: (c := conditions(get(apiserver, IS, NAME))["Validated"])["status"] == "True"
              and c["observedGeneration"] == get(apiserver, IS, NAME)["metadata"]["generation"], 60,
              "Validated=True for the autoscaled spec")

        set_waiting(stack, "prefill", 0)
        down = until(lambda: log.first(lambda d: d["result"] == 2), DOWN_DELAY_S + 60, "one step down")
        assert "no request waiting" in down["reason"] and "scaleDownDelay" in down["reason"]
        log.assert_after_delay(down, DOWN_DELAY_S)
        floor = until(lambda: log.first(lambda d: d["result"] == 1 and d["inputs"]["currentReplicas"] == 2),
                      DOWN_DELAY_S + 60, "a second step down, to minReplicas")
        log.assert_after_delay(floor, DOWN_DELAY_S)
        until(lambda: deployment_replicas(apiserver, "prefill") == 1, 60, "the prefill Deployment back at 1")
    finally:
        log.stop()
        set_waiting(stack, "prefill", 0)

    # The decode pods' decisions, on their own metrics and History, kept them at 2 all along.
    status = status_of(apiserver, NAME)
    decode = status["autoscaling"]["lastDecision"]
    assert decode["result"] == 2 and decode["inputs"]["waiting"] == 0 and "routerHeld" not in decode["inputs"]
    assert decision_time(decode) >= decision_time(floor)  # decided on (one tick decides both roles)
    assert "replicas" not in get(apiserver, IS, NAME)["spec"] and deployment_replicas(apiserver, "decode") == 2
    assert not [w for w in apiserver.api.writes if w.path.endswith("/scale")]
    assert conditions(get(apiserver, IS, NAME))["ScalingReady"]["status"] == "True"
    # One Event per prefill scaling, each saying so.
    until(lambda: sorted(e["message"].split(" replicas")[0] for e in events_for(apiserver, NAME)
                         if e["reason"].startswith("Scaled"))
          == ["prefill: 1 -> 3", "prefill: 2 -> 1", "prefill: 3 -> 2"], 30, "the prefill scaling Events")

    # spec.prefill.autoscaling removed: its part of the status goes (the decode pods' stays), and
    # prefill.replicas stays as the autoscaler last set it, now the spec's own count.
    patch_spec(apiserver, NAME, {"prefill": {"autoscaling": None}})
    until(lambda: "prefillAutoscaling" not in status_of(apiserver, NAME)
          and "PrefillScalingReady" not in conditions(get(apiserver, IS, NAME)), 60, "the prefill autoscaler's status gone")
    obj = get(apiserver, IS, NAME)
    assert obj["spec"]["prefill"]["replicas"] == 1 and "autoscaling" in obj["status"]
    assert conditions(obj)["ScalingReady"]["status"] == "True"
    until(lambda: (c := conditions(get(apiserver, IS, NAME))["Validated"])["status"] == "True"
          and c["observedGeneration"] == get(apiserver, IS, NAME)["metadata"]["generation"], 60, "Validated=True")
    assert deployment_replicas(apiserver, "prefill") == 1
