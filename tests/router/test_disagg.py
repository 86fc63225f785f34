"""Disaggregated prefill and decode on CPU, real processes: a prefill engine (`kv_producer`), a
decode engine (`kv_consumer`) and `pagoda route --prefill-backends --decode-backends` give the
same greedy tokens as one aggregated engine, with prefix hits on either side or none; the decode
engine receives the prompts' pages instead of computing them; faults (a dead producer, a refused
handshake, a hold never pulled) end in the consumer computing the prompt, with no page leaked."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pagoda_e2e import free_port, start_pagoda, until
from prometheus_client.parser import text_string_to_metric_families

MODEL = "pagoda-tiny"
BLOCK = 16
HOLD_S = 3


def _engine(tmp, name: str, transfer: dict | None):
    port = free_port()
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--num-kv-pages", "128",
            "--max-model-len", "512", "--block-size", str(BLOCK)]
    if transfer is not None:
        args += ["--kv-transfer-config", json.dumps(transfer)]
    return start_pagoda(args, tmp / f"{name}.log"), f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    procs = []
    try:
        extra = {"hold_timeout_s": HOLD_S, "transfer_timeout_s": 5}
        prefill, p_url = _engine(tmp, "prefill", {"kv_role": "kv_producer", "kv_port": 0,
                                                  "kv_connector_extra_config": extra})
        procs.append(prefill)
        decode, d_url = _engine(tmp, "decode", {"kv_role": "kv_consumer", "kv_connector_extra_config": extra})
        procs.append(decode)
        aggregated, a_url = _engine(tmp, "aggregated", None)
        procs.append(aggregated)
        for proc, url in ((prefill, p_url), (decode, d_url), (aggregated, a_url)):
            proc.wait_http(f"{url}/health", timeout=300)
        router_port = free_port()
        router = start_pagoda(["route", "--host", "127.0.0.1", "--port", str(router_port), "--health-interval", "0.2",
                               "--prefill-backends", p_url, "--decode-backends", d_url], tmp / "route.log")
        procs.append(router)
        r_url = f"http://127.0.0.1:{router_port}"
        router.wait_http(f"{r_url}/health", timeout=60)
        yield {"prefill": p_url, "decode": d_url, "aggregated": a_url, "router": r_url}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _tokens(url: str, prompt: list[int], max_tokens: int = 8, **extra) -> tuple[list[int], dict]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["token_ids"], body


def _prompt(seed: int, n: int) -> list[int]:
    return [10 + (seed * 37 + i * 11) % 400 for i in range(n)]


def _stats(url: str) -> dict[str, float]:
    """An engine's unlabelled figures (one core: the `engine="0"` series)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if set(s.labels) <= {"model_name", "engine"} and s.name.startswith("pagoda:")}


def test_greedy_tokens_equal_one_aggregated_engine_and_decode_computes_almost_no_prompt(cluster):
    client = openai.OpenAI(base_url=f"{cluster['router']}/v1", api_key="none")
    shared = _prompt(1, 3 * BLOCK)
    prompts = [
        _prompt(2, 5 * BLOCK + 3),  # no prefix hit anywhere
        shared + _prompt(3, 2 * BLOCK + 5),  # then a prefix hit on both sides
        shared + _prompt(4, 2 * BLOCK),  # a prompt ending on a page boundary
        _prompt(5, 7),  # shorter than a page: nothing to pull
    ]
    warm = _prompt(6, 4 * BLOCK + 1)
    _tokens(cluster["decode"], warm[:3 * BLOCK] + [1, 2, 3])  # the decode engine holds a prefix itself
    prompts.append(warm)
    before = _stats(cluster["decode"])
    for prompt in prompts:
        expected, _ = _tokens(cluster["aggregated"], prompt)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].token_ids == expected, prompt
        streamed = []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            streamed += chunk.choices[0].token_ids or [] if chunk.choices else []
        assert streamed == expected, prompt
    after = _stats(cluster["decode"])
    queried = after["pagoda:prefix_cache_queries_total"] - before["pagoda:prefix_cache_queries_total"]
    hits = after["pagoda:prefix_cache_hits_total"] - before["pagoda:prefix_cache_hits_total"]
    # Every request (sent twice: whole and streamed) computed only what follows its last usable
    # page (a prompt's last token is always computed, for its logits): the rest was received or hit.
    assert queried - hits == 2 * sum(len(p) - (len(p) - 1) // BLOCK * BLOCK for p in prompts), (queried, hits)
    received = after["pagoda:external_prefix_cache_hits_total"] - before["pagoda:external_prefix_cache_hits_total"]
    assert received >= 4 * BLOCK  # the pages of the first prompt alone, pulled once
    assert after["pagoda:kv_transfer_failures_total"] == before["pagoda:kv_transfer_failures_total"]
    router_metrics = httpx.get(f"{cluster['router']}/metrics", timeout=10).text
    assert 'pagoda_router:pd_requests_total{mode="disaggregated"}' in router_metrics


def test_a_chat_streams_the_decode_engines_answer(cluster):
    messages = [{"role": "system", "content": "You keep long context. " * 12},
                {"role": "user", "content": "Say something about pagodas."}]
    direct = openai.OpenAI(base_url=f"{cluster['aggregated']}/v1", api_key="none")
    routed = openai.OpenAI(base_url=f"{cluster['router']}/v1", api_key="none")
    settings = dict(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
    expected = direct.chat.completions.create(**settings).choices[0].message.content
    before = _stats(cluster["decode"])["pagoda:external_prefix_cache_hits_total"]
    assert routed.chat.completions.create(**settings).choices[0].message.content == expected
    text = "".join(chunk.choices[0].delta.content or "" for chunk in
                   routed.chat.completions.create(stream=True, **settings) if chunk.choices)
    assert text == expected
    assert _stats(cluster["decode"])["pagoda:external_prefix_cache_hits_total"] > before


def test_a_producer_returns_vllm_shaped_params_and_a_consumer_refuses_the_wrong_role(cluster):
    _, body = _tokens(cluster["prefill"], _prompt(7, 3 * BLOCK), max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == 2 and params["remote_block_size"] == BLOCK
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_fingerprint"):
        assert params[key], key
    r = httpx.post(f"{cluster['decode']}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(f"{cluster['aggregated']}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--kv-transfer-config" in r.json()["error"]["message"]
    # Through the router a client never names where a decode engine pulls from: only the router does.
    r = httpx.post(f"{cluster['router']}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": params})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert "set by the router" in r.json()["error"]["message"]
    # The producer frees the pages nobody pulled after the bound, idle or not.
    until(lambda: _stats(cluster["prefill"]).get("pagoda:kv_transfer_pages_held") == 0, HOLD_S + 10,
          "the producer's hold to expire")


def test_faults_fall_back_to_computing_and_leak_no_page(cluster):
    """Many requests whose pulls fail (a dead producer, a refused handshake, a hold already
    gone): every one answers the aggregated engine's tokens, and both pools return to idle."""
    decode, prefill = cluster["decode"], cluster["prefill"]
    before = _stats(decode)
    faults = 0
    for i in range(24):
        prompt = _prompt(100 + i, 3 * BLOCK + i % 5)
        expected, _ = _tokens(cluster["aggregated"], prompt, max_tokens=4)
        _, held = _tokens(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = dict(held["kv_transfer_params"])
        kind = i % 4
        if kind == 0:
            params["remote_port"] = free_port()  # nobody listens there: a dead producer
        elif kind == 1:
            params["remote_fingerprint"] = "0" * 32  # another model's pages: refused at the handshake
        elif kind == 2:
            params["remote_request_id"] = "gone"  # the hold is not there (expired, or never made)
        faults += kind != 3
        got, _ = _tokens(decode, prompt, max_tokens=4, kv_transfer_params=params)
        assert got == expected, (i, kind)
    after = _stats(decode)
    fallbacks = after["pagoda:kv_transfer_fallbacks_total"] - before["pagoda:kv_transfer_fallbacks_total"]
    assert fallbacks == faults
    # Idle again: every page is free on both sides (holds pulled, refused or expired).
    for url in (decode, prefill):
        until(lambda: _stats(url).get("pagoda:kv_cache_usage_perc") == 0.0, HOLD_S + 10, f"{url} to free its pages")
    assert _stats(prefill)["pagoda:kv_transfer_pages_held"] == 0


def test_router_flags_are_checked(tmp_path):
    proc = start_pagoda(["route", "--backends", "http://127.0.0.1:2", "--prefill-backends", "http://127.0.0.1:1"], tmp_path / "bad.log")
    assert proc.popen.wait(60) == 2
    assert "--prefill-backends needs --decode-backends" in proc.log_text()
    proc.stop()


def test_in_a_cluster_each_role_is_discovered_from_its_service(tmp_path):
    """`--decode-k8s-service` / `--prefill-k8s-service`: each pool follows its own Service's
    EndpointSlices (the Services the operator makes select the pods by their llm-d.ai/role label)."""
    from k8s_emulator import emulated_cluster
    from pagoda_e2e import PYTHON, Proc
    from test_discovery_k8s import FAKE, SLICES, endpoint_slice

    fakes, ports = [], []
    for i in range(2):
        ports.append(free_port())
        fakes.append(Proc([PYTHON, FAKE, "--port", str(ports[-1]), "--model", "tiny"], tmp_path / f"fake{i}.log"))
    try:
        for proc, port in zip(fakes, ports):
            proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
        with emulated_cluster(tmp_path) as cluster:
            cluster.apiserver.api.declare("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
            api = cluster.url + SLICES
            httpx.post(api, json=endpoint_slice("m-prefill-a", "m-prefill", ports[0])).raise_for_status()
            httpx.post(api, json=endpoint_slice("m-decode-a", "m-decode", ports[1])).raise_for_status()
            port = free_port()
            router = start_pagoda(["route", "--host", "127.0.0.1", "--port", str(port), "--health-interval", "0.5",
                                   "--decode-k8s-service", "default/m-decode", "--prefill-k8s-service",
                                   "default/m-prefill", "--kubeconfig", str(cluster.kubeconfig)], tmp_path / "r.log")
            base = f"http://127.0.0.1:{port}"
            try:
                router.wait_http(base + "/health", timeout=60)

                def pools() -> tuple[list[str], list[str]]:
                    described = httpx.get(base + "/router/backends", timeout=10).json()
                    return ([b["url"] for b in described.get("prefill_backends", [])],
                            [b["url"] for b in described["backends"]])

                until(lambda: pools() == ([f"http://127.0.0.1:{ports[0]}"], [f"http://127.0.0.1:{ports[1]}"]), 20,
                      "each role's pool from its own Service")
                r = httpx.post(base + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 1})
                assert r.status_code == 200 and r.headers["x-pagoda-backend"] == f"http://127.0.0.1:{ports[1]}"
            finally:
                router.stop()
    finally:
        for proc in fakes:
            proc.stop()
