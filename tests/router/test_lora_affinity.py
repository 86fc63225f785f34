"""The router and LoRA adapters, real processes: two `pagoda serve` replicas of one tiny Llama
with different adapters (`--lora-modules`, written by PEFT) behind `pagoda route`. Its
/v1/models is the union (adapters with their `parent`); a request of an adapter goes to the
replica that serves it; an adapter loaded at run time on the other replica shows in the union
and spreads its requests. The affinity itself (`adapter_affinity`: where the adapter runs, then a
free slot, then anywhere) and the `lora_requests_info` reader are checked on their own."""

from __future__ import annotations

import httpx
import openai
import pytest
from pagoda_e2e import free_port, start_pagoda, until

from pagoda_engine.router.backends import (Backend, BackendPool, LoRAInfo, adapter_affinity, is_adapter,
                                           parse_lora_info)

pytest.importorskip("peft")

from lora_adapters import ADAPTERS, write_adapter  # noqa: E402
from pagoda_engine.tiny import build_tiny_model  # noqa: E402


def _card(model_id: str, parent: str | None = None) -> dict:
    return {"id": model_id, "object": "model", **({"parent": parent} if parent else {})}


def _backend(url: str, adapters: list[str], running=(), waiting=(), max_lora=2, queued=0.0) -> Backend:
    b = Backend(url, ready=True, waiting=queued, models=[_card("base"), *(_card(a, "base") for a in adapters)])
    b.lora = LoRAInfo(frozenset(running), frozenset(waiting), max_lora)
    return b


def test_an_adapter_goes_where_it_runs_then_where_a_slot_is_free_then_where_it_is_served():
    a = _backend("http://a", ["x", "y"], running=["x"])
    b = _backend("http://b", ["x", "y"], running=["y", "z"])
    c = _backend("http://c", ["x"], running=[])
    assert is_adapter([a, b], "x") and not is_adapter([a, b], "base") and not is_adapter([a], "nope")
    assert [u.url for u in adapter_affinity([a, b, c], "x")] == ["http://a"]  # running there
    assert [u.url for u in adapter_affinity([a, b, c], "y")] == ["http://b"]
    # Running where requests queue: a replica with a free slot instead (c serves no y: a only).
    a.waiting, b.waiting = 0.0, 3.0
    assert [u.url for u in adapter_affinity([a, b, c], "y")] == ["http://a"]
    # Every slot taken everywhere: any replica that serves it.
    full = [_backend(f"http://{n}", ["w", "p", "q"], running=["p", "q"]) for n in "de"]
    assert [u.url for u in adapter_affinity(full, "w")] == ["http://d", "http://e"]
    # Waiting for a slot counts as resident: its weights are on their way there.
    assert [u.url for u in adapter_affinity([*full, _backend("http://f", ["w"], waiting=["w"])], "w")] == ["http://f"]


def test_the_endpoint_picker_puts_the_adapters_pods_first_in_its_fallback_list():
    """`pagoda epp` orders an adapter's request as `pagoda route` chooses: the pods where the
    adapter runs lead, then the other pods serving it (the base model's requests: by score alone)."""
    from pagoda_engine.router.epp import Picker
    from pagoda_engine.router.metrics import RouterMetrics
    from pagoda_engine.router.scorer import Weights

    pool = BackendPool(httpx.AsyncClient(), RouterMetrics())
    # The busier pod (more running) runs the adapter: by score alone it would come last.
    pool.backends = {b.url: b for b in (
        _backend("http://10.0.0.1:8000", ["x"], running=[], queued=0.0),
        _backend("http://10.0.0.2:8000", ["x"], running=["x"], queued=0.0))}
    pool.backends["http://10.0.0.2:8000"].running = 3.0
    picker = Picker(pool, None, Weights(), queue_limit=128)
    assert picker.pick({"model": "base", "prompt": "hi"}, None) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert picker.pick({"model": "x", "prompt": "hi"}, None) == ["10.0.0.2:8000", "10.0.0.1:8000"]


def test_lora_requests_info_is_read_from_its_newest_series():
    text = "\n".join([
        "# TYPE pagoda:lora_requests_info gauge",
        'pagoda:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e+09',
        'pagoda:lora_requests_info{max_lora="4",running_lora_adapters="c",waiting_lora_adapters="d,e"} 1.8e+09',
        'pagoda:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.6e+09',
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="zzz",waiting_lora_adapters=""} 1.9e+09',
        "pagoda:num_requests_running 2.0",
    ])
    assert parse_lora_info(text) == LoRAInfo(frozenset({"c"}), frozenset({"d", "e"}), 4)
    assert parse_lora_info("pagoda:num_requests_running 2.0\n") is None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-route")
    model_dir = build_tiny_model(tmp / "model", arch="llama", seed=3)
    paths = {name: write_adapter(model_dir, tmp / name, *ADAPTERS[name], seed=i + 1)
             for i, name in enumerate(("qv", "mlp"))}
    procs, urls = [], {}
    try:
        for name, adapter in (("one", "qv"), ("two", "mlp")):
            port = free_port()
            procs.append(start_pagoda([
                "serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir),
                "--served-model-name", "base", "--dtype", "float32", "--num-kv-pages", "256", "--max-model-len", "256",
                "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                "--lora-modules", f"{adapter}={paths[adapter]}"], tmp / f"{name}.log",
                env={"PAGODA_ALLOW_RUNTIME_LORA_UPDATING": "1"}))
            urls[name] = f"http://127.0.0.1:{port}"
        for proc, url in zip(procs, urls.values()):
            proc.wait_http(f"{url}/health", timeout=300)
        router_port = free_port()
        procs.append(start_pagoda(["route", "--host", "127.0.0.1", "--port", str(router_port), "--health-interval",
                                   "0.2", "--backends", ",".join(urls.values())], tmp / "route.log"))
        urls["router"] = f"http://127.0.0.1:{router_port}"
        procs[-1].wait_http(f"{urls['router']}/health", timeout=60)
        yield urls, paths
    finally:
        for proc in reversed(procs):
            proc.stop()


def _models(url: str) -> dict[str, str | None]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        return {m.id: getattr(m, "parent", None) for m in client.models.list().data}


def _answered_by(url: str, model: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        raw = client.completions.with_raw_response.create(model=model, prompt="hello there", max_tokens=2,
                                                          temperature=0)
        assert raw.parse().model == model
        return raw.headers["x-pagoda-backend"]


def test_models_is_the_union_and_each_adapter_goes_to_the_replica_that_serves_it(cluster):
    urls, _ = cluster
    until(lambda: set(_models(urls["router"])) == {"base", "qv", "mlp"}, 30, "both replicas' models")
    assert _models(urls["router"]) == {"base": None, "qv": "base", "mlp": "base"}
    for _ in range(4):
        assert _answered_by(urls["router"], "qv") == urls["one"]
        assert _answered_by(urls["router"], "mlp") == urls["two"]
    assert {_answered_by(urls["router"], "base") for _ in range(6)} <= {urls["one"], urls["two"]}


def test_an_adapter_loaded_at_run_time_joins_the_union_and_its_replica_takes_its_requests(cluster):
    urls, paths = cluster
    loaded = httpx.post(f"{urls['two']}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["qv"]},
                        timeout=60)
    assert loaded.status_code == 200, loaded.text
    until(lambda: _models(urls["router"]).get("late") == "base", 30, "the new adapter in the router's /v1/models")
    assert _answered_by(urls["router"], "late") == urls["two"]
    assert httpx.post(f"{urls['two']}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
    until(lambda: "late" not in _models(urls["router"]), 30, "the unloaded adapter gone from the router's /v1/models")
