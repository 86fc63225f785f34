"""End to end on one machine with real parts: `pagoda serve` replicas, `pagoda route`, a real
Prometheus, and the operator's autoscaler (kopf) deciding from that Prometheus, its decisions
applied to the InferenceService in the emulated Kubernetes API (in a real cluster, Kubernetes
turns spec.replicas into pods; here the test starts the engine itself when scaling from zero).

Tests run in file order on one shared stack; the replica kill comes last."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from conftest import CLIENT_KEY, INTERNAL_KEY
from k8s_emulator import autoscaler_operator, emulated_cluster, inference_service
from pagoda_e2e import until

pytestmark = pytest.mark.e2e
MODEL = "pagoda-tiny"
# A router takes a client's key; an engine only the internal key the routers hold.
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
INTERNAL = {"Authorization": f"Bearer {INTERNAL_KEY}"}
SHARED_PREFIX = ("You are Pagoda's test assistant. Answer in one short sentence, in plain words, without "
                 "lists or formatting. The following context describes a fictional city of pagodas. ") * 6


def engine_counter(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(base: str, prompt: str, max_tokens: int = 8, timeout: float = 120, **extra) -> httpx.Response:
    """A completion through the router at `base`."""
    return httpx.post(base + "/v1/completions", timeout=timeout, headers=CLIENT,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def test_streams_through_the_router_carry_the_same_tokens_as_direct(stack):
    u = stack["url"]
    for base in (u["a"], u["b"]):
        direct = openai.OpenAI(base_url=base + "/v1", api_key=INTERNAL_KEY)
        routed = openai.OpenAI(base_url=u["router"] + "/v1", api_key=CLIENT_KEY)
        for client_kind in ("completions", "chat"):
            texts = []
            for client in (direct, routed):
                if client_kind == "completions":
                    stream = client.completions.create(model=MODEL, prompt="The pagoda stands", max_tokens=24,
                                                       temperature=0, stream=True)
                    chunks = [c.choices[0].text for c in stream if c.choices]
                else:
                    stream = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, stream=True,
                                                            messages=[{"role": "user", "content": "Tell me a story"}])
                    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
                texts.append(chunks)
            assert texts[0] == texts[1] and len(texts[0]) >= 20, client_kind


def test_each_edge_takes_only_its_own_key_and_probes_need_none(stack):
    u = stack["url"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for base, wrong in ((u["router"], INTERNAL), (u["router"], {}), (u["a"], CLIENT), (u["a"], {})):
        r = httpx.post(base + "/v1/completions", json=body, headers=wrong)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key"), (base, wrong)
    for base in (u["router"], u["a"], u["b"]):
        assert httpx.get(base + "/health").status_code == httpx.get(base + "/metrics").status_code == 200


def test_bench_serve_s1_through_the_router(stack, tmp_path, monkeypatch):
    """`pagoda bench serve` against the router: every streamed request completes, and the
    engines behind it generated exactly the tokens the benchmark counted."""
    from pagoda_engine.cli import main
    from pagoda_engine.tiny import default_model_dir

    monkeypatch.setenv("OPENAI_API_KEY", CLIENT_KEY)

    u = stack["url"]
    generated = lambda: sum(engine_counter(u[k], "pagoda:generation_tokens_total") for k in ("a", "b"))  # noqa: E731
    before = generated()
    out = tmp_path / "s1.json"
    assert main(["bench", "serve", "--base-url", u["router"], "--model", str(default_model_dir()),
                 "--num-prompts", "12", "--input-len", "32", "--output-len", "8", "--request-rate", "40",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["input_tokens"], r["output_tokens"]) == (12, 0, 12 * 32, 12 * 8)
    # Under load the client can read several tokens of a stream at once (gaps of 0), not all of them.
    assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] and r["itl_ms"]["p99"] > 0
    assert generated() - before == 12 * 8


def test_prefix_aware_routing_keeps_a_shared_prefix_on_one_replica_with_bounded_load(stack):
    u = stack["url"]
    before = {k: engine_counter(u[k], "pagoda:prefix_cache_hits_total") for k in ("a", "b")}
    homes = [complete(u["router"], SHARED_PREFIX + f"Question {i}: what is tall?").headers["x-pagoda-backend"]
             for i in range(6)]
    assert len(set(homes)) == 1
    home = "a" if homes[0] == u["a"] else "b"
    other = "b" if home == "a" else "a"
    after = {k: engine_counter(u[k], "pagoda:prefix_cache_hits_total") for k in ("a", "b")}
    assert after[home] - before[home] >= 5 * 16  # five later requests, each hitting many full pages
    assert after[other] == before[other]
    # A burst of the same prefix, all open at once: bounded loads spill part of it to the other
    # replica. The streams are opened one after another and held open (1000 tokens each: none
    # ends while the rest are placed), so what the router sees is the burst itself, whatever
    # the machine's speed. The first goes home; neither replica takes more than the bound,
    # ceil(1.25 x 10 / 2) = 7, plus one for a load the router scraped before an earlier
    # request's end. (How many stay home depends on the order of placements: a spilled
    # request makes the other replica the prefix's latest holder.)
    with contextlib.ExitStack() as streams:
        served = []
        for i in range(10):
            r = streams.enter_context(httpx.stream(
                "POST", u["router"] + "/v1/completions", timeout=120, headers=CLIENT,
                json={"model": MODEL, "prompt": SHARED_PREFIX + f"Burst {i}", "max_tokens": 1000,
                      "ignore_eos": True, "temperature": 0, "stream": True}))
            assert r.status_code == 200
            served.append(r.headers["x-pagoda-backend"])
    assert served[0] == homes[0]
    assert set(served) == {u["a"], u["b"]}
    assert max(served.count(u["a"]), served.count(u["b"])) <= 8, served
    # closing them aborts them on the engines (the next tests start from idle replicas)
    until(lambda: all(engine_counter(u[k], "pagoda:num_requests_running")
                      + engine_counter(u[k], "pagoda:num_requests_waiting") == 0 for k in ("a", "b")),
          60, "the closed streams to leave the engines")


@pytest.mark.parametrize("body", [
    b"{not json",
    b"[]",
    b'{"model": "\xff\xfe"}',  # not UTF-8
    b"[" * 100000,  # nesting too deep for the parser
    json.dumps({"model": MODEL}).encode(),
    json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(),
    json.dumps({"model": MODEL, "prompt": "x", "temperature": "warm"}).encode(),
    json.dumps({"model": MODEL, "prompt": [1, -5]}).encode(),
    json.dumps({"model": "no-such-model", "prompt": "x"}).encode(),
    json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100000}).encode(),  # over max_model_len: the engine says so
])
def test_malformed_requests_get_the_engines_answer_from_the_router(stack, body):
    u = stack["url"]
    headers = {"content-type": "application/json"}
    direct = httpx.post(u["a"] + "/v1/completions", content=body, headers={**headers, **INTERNAL})
    routed = httpx.post(u["router"] + "/v1/completions", content=body, headers={**headers, **CLIENT})
    assert 400 <= direct.status_code < 500
    assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())


# Several decision intervals (1 s) and Prometheus scrapes (1 s) long, so "not before the delay"
# is unambiguous even when a loaded machine spaces decisions out.
DOWN_DELAY_S = 5


def test_burst_scales_up_and_quiet_scales_down_after_the_delay(stack, tmp_path):
    u = stack["url"]
    with emulated_cluster(tmp_path) as cluster, autoscaler_operator(cluster.url):
        # minReplicas 2: an idle start stays at 2, so the only scale-down is the one after the burst
        cluster.create(inference_service("tiny", replicas=2, autoscaling={
            "minReplicas": 2, "maxReplicas": 4, "policy": "queue", "target": 1, "scaleUpDelay": "0s",
            "scaleDownDelay": f"{DOWN_DELAY_S}s", "intervalSeconds": 1, "prometheusURL": stack["url"]["prom"]}))
        cluster.set_status("tiny", {"replicas": 2, "readyReplicas": 2})
        with cluster.recording_decisions("tiny") as log:
            until(lambda: log.first(lambda d: d["result"] == 2), 60, "a steady first decision")

            stop = threading.Event()

            def load(i):
                while not stop.is_set():
                    complete(u["router"], f"load {i} " * 8, max_tokens=200, ignore_eos=True)

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                workers = [pool.submit(load, i) for i in range(12)]
                try:
                    up = until(lambda: log.first(lambda d: d["result"] > d["inputs"]["currentReplicas"]), 120,
                               "a scale-up under load")
                finally:
                    stop.set()
                for w in workers:
                    w.result(300)
            # the queue Prometheus saw (the engines' waiting requests) is what drove it, at once
            assert up["inputs"]["currentReplicas"] == 2 and up["result"] > 2, up
            assert up["inputs"]["waiting"] > 2 and "ceil(" in up["reason"], up
            assert up is log.first(lambda d: d["inputs"].get("waiting", 0) > 2)

            # the queue empties only after the in-flight requests finish; then one step down,
            # not before it has stayed empty for scaleDownDelay
            down = until(lambda: log.first(lambda d: d["result"] < d["inputs"]["currentReplicas"]),
                         DOWN_DELAY_S + 120, "a scale-down after the load")
            assert down["result"] == down["inputs"]["currentReplicas"] - 1 >= 2, down
            assert down["inputs"]["waiting"] == 0 and "scaleDownDelay" in down["reason"], down
            log.assert_after_delay(down, DOWN_DELAY_S)
        # both were applied: the Events carry the counts (spec.replicas may have moved on since)
        scalings = {(up["inputs"]["currentReplicas"], up["result"], "ScaledUp"),
                    (down["inputs"]["currentReplicas"], down["result"], "ScaledDown")}
        until(lambda: scalings <= {(*map(int, e["message"].split(" replicas")[0].split(" -> ")), e["reason"])
                                   for e in cluster.events() if e["reason"] in ("ScaledUp", "ScaledDown")}, 30,
              "the ScaledUp and ScaledDown Events")


def test_held_request_scales_from_zero_then_idle_scales_to_zero(stack, tmp_path):
    u = stack["url"]
    with emulated_cluster(tmp_path) as cluster, autoscaler_operator(cluster.url):
        cluster.create(inference_service("zero", replicas=0, autoscaling={
            "minReplicas": 0, "maxReplicas": 2, "policy": "queue", "scaleDownDelay": f"{DOWN_DELAY_S}s",
            "intervalSeconds": 1, "prometheusURL": u["prom"]}))
        with cluster.recording_decisions("zero") as log:
            until(lambda: cluster.decided("zero", 0), 60, "a first decision at zero")
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # held by the router until a replica is up: the engine's start on a loaded machine
                # counts against this request's timeout
                held = pool.submit(complete, u["zero_router"], "Hello from zero", 8, timeout=600)
                until(lambda: cluster.decided("zero", 1), 60, "scale from zero")
                assert "scale from zero" in cluster.get("zero")["status"]["autoscaling"]["lastDecision"]["reason"]
                assert not held.done()
                engine = stack["start_late_engine"]()  # Kubernetes would start the pod now
                try:
                    cluster.set_status("zero", {"replicas": 1, "readyReplicas": 1})
                    response = held.result(600)
                    assert response.status_code == 200 and response.json()["choices"][0]["text"]
                    # nothing more to do: after scaleDownDelay of idleness, back to zero
                    zero = until(lambda: log.first(lambda d: d["result"] == 0 and d["inputs"]["currentReplicas"] == 1),
                                 DOWN_DELAY_S + 120, "scale to zero")
                    log.assert_after_delay(zero, DOWN_DELAY_S)
                    until(lambda: cluster.decided("zero", 0), 30, "spec.replicas = 0")
                    until(lambda: any(e.get("reason") == "ScaledToZero" for e in cluster.events()), 30,
                          "the ScaledToZero Event")
                finally:
                    engine.stop()


def test_prometheus_stopped_sets_scaling_ready_false_and_changes_nothing(stack, tmp_path):
    with emulated_cluster(tmp_path) as cluster, autoscaler_operator(cluster.url):
        cluster.create(inference_service("tiny", replicas=2, autoscaling={
            "minReplicas": 1, "maxReplicas": 4, "scaleDownDelay": "600s", "intervalSeconds": 1,
            "prometheusURL": stack["url"]["prom"]}))
        cluster.set_status("tiny", {"replicas": 2, "readyReplicas": 2})
        until(lambda: cluster.scaling_ready("tiny")["status"] == "True", 60, "ScalingReady=True")
        stack["prom"].stop()
        until(lambda: cluster.scaling_ready("tiny")["status"] == "False", 60, "ScalingReady=False")
        assert cluster.scaling_ready("tiny")["reason"] == "PrometheusUnavailable"
        time.sleep(2)
        assert cluster.get("tiny")["spec"]["replicas"] == 2 and not cluster.scale_writes()


def test_killed_replica_s_streams_continue_on_the_survivor_which_serves_the_rest(stack):
    u = stack["url"]
    router = u["router"]

    def stream(i):
        with httpx.stream("POST", router + "/v1/completions", timeout=120, headers=CLIENT,
                          json={"model": MODEL, "prompt": f"Stream number {i} " * 3, "max_tokens": 1500,
                                "ignore_eos": True, "temperature": 0, "stream": True}) as r:
            return r.headers["x-pagoda-backend"], [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    def migrations() -> float:
        text = httpx.get(router + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagoda_router:migrations_total"))

    migrated_before = migrations()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        until(lambda: engine_counter(u["a"], "pagoda:num_requests_running") > 0, 30, "streams on replica a")
        time.sleep(0.5)
        stack["engines"]["a"].kill()
        results = [f.result(120) for f in futures]
    cut = [frames for backend, frames in results if backend == u["a"]]
    assert cut and len(cut) < len(results)
    # every stream, those cut by the kill too, ends whole: continued on the survivor, no error frame
    for _, frames in results:
        assert frames[-1] == "data: [DONE]"
        assert not any('"error"' in f for f in frames), frames[-3:]
    assert migrations() - migrated_before >= len(cut)
    # requests that start after the kill: all served by the survivor, none a 5xx
    responses = [complete(router, f"after the kill {i}") for i in range(6)]
    assert [r.status_code for r in responses] == [200] * 6
    assert {r.headers["x-pagoda-backend"] for r in responses} == {u["b"]}
