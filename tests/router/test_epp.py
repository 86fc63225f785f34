"""`pagoda epp` over three real engines (`pagoda serve`, the tiny model, KV events on), driven by
a client speaking Envoy's ext_proc v3 as Envoy does (`envoy_ext_proc.py`): requests sharing a long
prefix go to the engine that holds it once its KV events arrive; an engine whose /metrics shows a
full queue is passed over; the subset hint is obeyed; 503 with no ready endpoint; the
FULL_DUPLEX_STREAMED mode GAIE's gateways use; gRPC health."""

from __future__ import annotations

import json
import os
import threading
import time

import grpc
import httpx
import pytest
from envoy_ext_proc import DUPLEX, ext_proc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagoda_e2e import engines_with_kv_events, free_port, start_pagoda, until
from streams import cores_paused

MODEL = "pagoda-tiny"
QUEUE_LIMIT = 3
WAITING_LIMIT = QUEUE_LIMIT + 3  # each engine's --max-waiting-requests


def _epp(tmp_path, backends: list[str], *extra: str, env: dict | None = None):
    port = free_port()
    proc = start_pagoda(["epp", "--host", "127.0.0.1", "--port", str(port), "--backends", ",".join(backends),
                         "--metrics-interval", "0.1", *extra], tmp_path / f"epp-{port}.log", env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def ready():
        if not proc.alive():
            raise RuntimeError(proc.log_text()[-3000:])
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                               timeout=1)
            return answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    until(ready, 120, "the EPP's readiness")
    return proc, channel


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("epp")
    events = free_port()
    extra = ("--max-num-seqs", "1", "--max-waiting-requests", str(WAITING_LIMIT))
    with engines_with_kv_events(tmp, 3, events, MODEL, extra=extra) as (engines, urls):
        epp, channel = _epp(tmp, urls, "--model", MODEL, "--kv-events-bind", f"tcp://127.0.0.1:{events}",
                            "--queue-limit", str(QUEUE_LIMIT))
        yield {"urls": urls, "endpoints": [url.removeprefix("http://") for url in urls], "channel": channel,
               "engines": engines, "tmp": tmp}
        channel.close()
        epp.stop()


def _prefix(tenant: int) -> str:
    return " ".join(f"tenant{tenant} shares this system prompt line {i}." for i in range(8))


def test_health_services(cluster):
    stub = health_pb2_grpc.HealthStub(cluster["channel"])
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_an_idle_cluster_gets_an_ordered_fallback_list_in_the_header_and_the_metadata(cluster):
    pick = ext_proc(cluster["channel"], {"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert pick.status is None
    assert sorted(pick.endpoints) == sorted(cluster["endpoints"])  # all three, best first


def test_a_shared_prefix_goes_to_the_engine_holding_it_once_its_events_arrive(cluster):
    channel, endpoints = cluster["channel"], cluster["endpoints"]
    prefix = _prefix(1)
    question = {"model": MODEL, "prompt": prefix + " Question one?", "max_tokens": 1}
    before = ext_proc(channel, question).endpoints[0]
    holder = next(e for e in endpoints if e != before)  # not the one it would pick anyway
    r = httpx.post(f"http://{holder}/v1/completions", json={"model": MODEL, "prompt": prefix + " Warm up.",
                                                             "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    until(lambda: ext_proc(channel, question).endpoints[0] == holder, 15, "the pick to follow the KV events")
    for i in range(5):
        other = {"model": MODEL, "prompt": prefix + f" A different question {i}?", "max_tokens": 1}
        assert ext_proc(channel, other).endpoints[0] == holder
    fresh = ext_proc(channel, {"model": MODEL, "prompt": _prefix(2) + " unrelated", "max_tokens": 1})
    assert fresh.endpoints[0] == before  # no engine holds that prefix: load and name decide as before


def test_an_engine_reporting_a_full_queue_is_passed_over_even_with_the_prefix(cluster):
    channel, endpoints = cluster["channel"], cluster["endpoints"]
    prefix = _prefix(3)
    question = {"model": MODEL, "prompt": prefix + " Which engine?", "max_tokens": 1}
    holder = endpoints[-1]
    httpx.post(f"http://{holder}/v1/completions", json={"model": MODEL, "prompt": prefix, "max_tokens": 1},
               timeout=60).raise_for_status()
    until(lambda: ext_proc(channel, question).endpoints[0] == holder, 15, "the pick to follow the KV events")

    answers: list[int] = []

    def long_request():
        answers.append(httpx.post(f"http://{holder}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "busy", "max_tokens": 300, "min_tokens": 300, "ignore_eos": True}).status_code)

    # The holder's core is frozen while the requests go in, so however slowly a loaded machine
    # sends them none is finished before the last arrives: its API server queues them until the
    # first answered 429 (--max-waiting-requests) shows WAITING_LIMIT wait. Let go, the core (with
    # --max-num-seqs 1) runs one and reports the others waiting on its /metrics.
    threads: list[threading.Thread] = []
    with cores_paused([cluster["engines"][-1].pid]):
        while 429 not in answers:
            assert len(threads) < 3 * WAITING_LIMIT, f"no 429 from the holder's full queue: {answers}"
            threads.append(threading.Thread(target=long_request))
            threads[-1].start()
            threads[-1].join(0.2)
    try:
        until(lambda: ext_proc(channel, question).endpoints[0] != holder, 30, "the full engine to be passed over")
        assert ext_proc(channel, question).endpoints[-1] == holder  # still the last resort in the list
    finally:
        for t in threads:
            t.join()
    assert answers.count(200) >= WAITING_LIMIT, answers
    until(lambda: ext_proc(channel, question).endpoints[0] == holder, 30, "the drained engine to be picked again")


def test_the_subset_hint_is_obeyed_and_an_empty_or_foreign_subset_is_503(cluster):
    channel, endpoints = cluster["channel"], cluster["endpoints"]
    body = {"model": MODEL, "prompt": _prefix(1) + " subset?", "max_tokens": 1}
    for chosen in ([endpoints[0]], endpoints[1:]):
        assert sorted(ext_proc(channel, body, subset=chosen).endpoints) == sorted(chosen)
    for subset in ([], ["10.255.255.1:8000"]):
        pick = ext_proc(channel, body, subset=subset)
        assert pick.status == 503 and pick.header is None
        assert pick.immediate_body["error"]["code"] == 503


def test_full_duplex_streamed_answers_the_headers_with_the_pick_then_streams_the_body_back(cluster):
    body = b'{"model": "pagoda-tiny", "messages": [{"role": "user", "content": "hi there"}]}'
    pick = ext_proc(cluster["channel"], body, mode=DUPLEX, path="/v1/chat/completions")
    assert [r.WhichOneof("response") for r in pick.responses] == ["request_headers", "request_body"]
    assert pick.endpoints[0] in cluster["endpoints"]
    assert pick.body_back == body


def test_a_body_that_is_not_a_json_object_is_a_400_in_openais_shape(cluster):
    for raw in (b"[1, 2]", b"{not json"):
        pick = ext_proc(cluster["channel"], raw)
        assert pick.status == 400
        assert pick.immediate_body["error"]["type"] == "invalid_request_error"


def test_no_ready_endpoint_is_a_503(cluster):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc, channel = _epp(cluster["tmp"], [gone])
    try:
        pick = ext_proc(channel, {"model": MODEL, "prompt": "anyone?"})
        assert pick.status == 503 and pick.header is None
    finally:
        channel.close()
        proc.stop()


def test_the_engines_key_is_set_on_the_routed_request(cluster):
    """The gateway holds no key: the picker presents the engines' own (the operator's internal key)."""
    proc, channel = _epp(cluster["tmp"], cluster["urls"], env={"PAGODA_BACKEND_API_KEY": "engine-key"})
    try:
        pick = ext_proc(channel, {"model": MODEL, "prompt": "with a key"})
        headers = {o.header.key: o.header.raw_value for r in pick.responses
                   for o in r.request_body.response.header_mutation.set_headers}
        assert headers["authorization"] == b"Bearer engine-key"
        assert pick.endpoints[0] in cluster["endpoints"]
    finally:
        channel.close()
        proc.stop()


def test_priorities_order_the_requests_held_while_the_pool_is_saturated(cluster):
    """Flow control over one engine (the subset): while its queue is full, requests are held, then
    released highest objective first whatever their arrival order. The priorities come from an
    objectives file (the operator's ConfigMap), changed after the picker started: the new ones
    order the queue."""
    engine = cluster["endpoints"][0]
    objectives = cluster["tmp"] / "objectives.json"
    objectives.write_text(json.dumps({"interactive": 0, "batch": 10}))
    # Held requests are not sent on, so each release waits for the next poll to show room again: a
    # second between polls keeps the releases (and the callers' returns) far enough apart that a
    # loaded machine's thread scheduling cannot reorder what the test sees (at 0.1 s it did).
    proc, channel = _epp(cluster["tmp"], cluster["urls"], "--queue-limit", "1", "--flow-control-queue", "8",
                         "--flow-control-timeout", "600", "--objectives-file", str(objectives), "--metrics-interval", "1")
    swapped = objectives.with_name("objectives.json.new")  # replaced whole, as kubelet swaps a ConfigMap
    swapped.write_text(json.dumps({"interactive": 10, "batch": 0}))
    os.replace(swapped, objectives)
    done: list[str] = []
    try:
        def long_request():
            httpx.post(f"http://{engine}/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": "busy", "max_tokens": 400, "min_tokens": 400, "ignore_eos": True})

        # One runs, the rest wait (--max-num-seqs 1): 400 steps each, a tiny model's step a
        # millisecond or more, so the queue stays full for ten seconds or more on any machine.
        busy = [threading.Thread(target=long_request) for _ in range(24)]
        for t in busy:
            t.start()

        def wait_until_saturated():
            return float(httpx.get(f"http://{engine}/metrics", timeout=5).text.split(
                "pagoda:num_requests_waiting{")[1].split("} ")[1].split()[0]) >= 1

        until(wait_until_saturated, 30, "the engine's queue to fill")

        def picker_holds():
            # The picker's own view, not the engine's: a probe it holds (the call runs out of
            # time) shows a scrape of the full queue; it stays full (the long requests wait),
            # so every later scrape says so too. The given-up probe leaves the queue.
            try:
                ext_proc(channel, {"model": MODEL, "prompt": "probe"}, subset=[engine], timeout=1.5)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return True
                raise
            return False

        until(picker_holds, 60, "the picker to hold requests for the full engine")
        time.sleep(0.5)  # the probe's cancellation reaches the picker

        def held(name: str, objective: str, fairness: str):
            pick = ext_proc(channel, {"model": MODEL, "prompt": name}, subset=[engine], timeout=120,
                            headers={"x-llm-d-inference-objective": objective,
                                     "x-llm-d-inference-fairness-id": fairness})
            assert pick.status is None and pick.endpoints == [engine], pick.immediate_body
            done.append(name)

        callers = []
        for name, objective, fairness in (("batch-1", "batch", "a"), ("batch-2", "batch", "b"),
                                          ("interactive-1", "interactive", "a"), ("interactive-2", "interactive", "b")):
            callers.append(threading.Thread(target=held, args=(name, objective, fairness)))
            callers[-1].start()
            time.sleep(0.1)
        assert done == []  # all held while the engine's queue is full
        for t in callers:
            t.join(timeout=180)
        for t in busy:
            t.join()
    finally:
        channel.close()
        proc.stop()
    assert done[:2] == ["interactive-1", "interactive-2"] and sorted(done[2:]) == ["batch-1", "batch-2"], done


def test_bad_flags_exit_2_naming_the_flag(cluster):
    for flags, says in ((["--backends", "http://127.0.0.1:1", "--kv-events-port", "5557"], "--model"),
                        (["--backends", "ftp://x"], "scheme"),
                        (["--backends", "http://127.0.0.1:1", "--queue-limit", "0"], "--queue-limit"),
                        (["--backends", "http://127.0.0.1:1", "--objectives-file", str(cluster["tmp"] / "none.json")],
                         "--objectives-file")):
        proc = start_pagoda(["epp", *flags], cluster["tmp"] / "bad.log")
        deadline = time.monotonic() + 60
        while proc.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.popen.returncode == 2 and says in proc.log_text(), proc.log_text()
        proc.stop()


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory):
    """Two engines serving the tiny model and a PEFT adapter of it (`sql`), with KV events."""
    pytest.importorskip("peft")
    from lora_adapters import write_adapter

    from pagoda_engine.model_path import resolve_model_path

    tmp = tmp_path_factory.mktemp("epp-lora")
    adapter = write_adapter(resolve_model_path(MODEL), tmp / "sql", 4, 8, True, ["q_proj", "v_proj"], seed=1)
    events = free_port()
    extra = ("--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8")
    with engines_with_kv_events(tmp, 2, events, MODEL, extra=extra) as (_, urls):
        epp, channel = _epp(tmp, urls, "--model", MODEL, "--kv-events-bind", f"tcp://127.0.0.1:{events}",
                            "--metrics-interval", "0.1")
        yield {"endpoints": [url.removeprefix("http://") for url in urls], "channel": channel}
        channel.close()
        epp.stop()


def test_an_adapters_pages_draw_its_requests_and_not_the_base_models(lora_cluster):
    """Pages an engine computed under an adapter hold other K/V than the base model's: they draw
    that adapter's requests sharing the prefix, never the base model's."""
    channel, endpoints = lora_cluster["channel"], lora_cluster["endpoints"]
    prefix = _prefix(4)
    base_question = {"model": MODEL, "prompt": prefix + " Base?", "max_tokens": 1}
    before = ext_proc(channel, base_question).endpoints[0]
    holder = next(e for e in endpoints if e != before)
    httpx.post(f"http://{holder}/v1/completions", json={"model": "sql", "prompt": prefix, "max_tokens": 1},
               timeout=60).raise_for_status()
    adapter_question = {**base_question, "model": "sql"}
    until(lambda: ext_proc(channel, adapter_question).endpoints[0] == holder, 15, "the adapter's pick to follow")
    assert ext_proc(channel, base_question).endpoints[0] == before  # the adapter's pages are no base hit
