"""`pagoda serve --enable-lora`: adapters from --lora-modules (both of vLLM's forms) and loaded at
run time (PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1) are models in /v1/models (`parent` = the base); a
request's `model` selects its adapter, whose greedy tokens equal transformers + PEFT's; vLLM's
load/unload bodies and answers; loads and unloads while requests run lose none; the
`lora_requests_info` gauge as vLLM exports it. One server for the module, the official client."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

pytest.importorskip("peft")

from conftest import Server  # noqa: E402
from lora_adapters import ADAPTERS, peft_greedy, write_adapter  # noqa: E402
from pagoda_e2e import free_port, start_engine  # noqa: E402

from pagoda_engine.tiny import build_tiny_model  # noqa: E402

NEW_TOKENS = 8
PROMPT = [(7 * i + 11) % 500 + 5 for i in range(20)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = build_tiny_model(root / "model", arch="llama", seed=3)
    paths = {name: write_adapter(model_dir, root / name, *spec, seed=i + 1)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    expected = {name: peft_greedy(model_dir, paths.get(name), [PROMPT], NEW_TOKENS)[0] for name in [None, *paths]}
    return root, model_dir, paths, expected


@pytest.fixture(scope="module")
def server(setup):
    root, model_dir, paths, _ = setup
    port = free_port()
    proc = start_engine(port, root / "serve.log", env={"PAGODA_ALLOW_RUNTIME_LORA_UPDATING": "1"}, extra=[
        "--model", str(model_dir), "--served-model-name", "base", "--dtype", "float32", "--num-kv-pages", "256",
        "--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"all7={paths['all7']}", json.dumps({"name": "qv", "path": paths["qv"],
                                                                "base_model_name": "org/base-1"})])
    yield Server(proc, port)
    proc.stop()


def _complete(server: Server, model: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.base_url}/completions", timeout=timeout, json={
        "model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_models_lists_the_adapters_with_their_parent(server, setup):
    import openai

    _, _, paths, _ = setup
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"base", "all7", "qv"}
    assert getattr(cards["base"], "parent", None) is None
    assert cards["all7"].parent == "base" and cards["all7"].root == paths["all7"]
    assert cards["qv"].parent == "org/base-1"  # its JSON entry's base_model_name


def test_model_selects_the_adapter_and_its_tokens_equal_peft(server, setup):
    _, _, _, expected = setup
    assert _tokens(_complete(server, "base")) == expected[None]
    assert _tokens(_complete(server, "all7")) == expected["all7"]
    assert _tokens(_complete(server, "qv")) == expected["qv"]


def test_chat_with_an_adapter_and_an_unknown_model(server):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(model="all7", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].message.content is not None and reply.model == "all7"
        chunks = list(client.completions.create(model="qv", prompt="hi", max_tokens=3, stream=True))
        assert chunks and all(c.model == "qv" for c in chunks)
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="nobody", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "all7" in info.value.body["message"]


def test_runtime_load_and_unload_as_vllm_answers(server, setup):
    _, _, paths, expected = setup
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": paths["mlp"]}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'mlp' added successfully."
    assert _tokens(_complete(server, "mlp")) == expected["mlp"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": paths["mlp"]}, timeout=60)
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": "/nonexistent"}, timeout=60)
    assert r.status_code == 400
    assert "LoRA adapter 'ghost'" in r.json()["error"]["message"] and "not a directory" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'mlp' removed successfully."
    assert _complete(server, "mlp").status_code == 404
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'mlp' cannot be found."
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert r.status_code == 400  # lora_path missing


def test_loads_and_unloads_under_load_lose_no_request(server, setup):
    """Requests on the base and three adapters (more than the two slots) run while a fourth
    adapter is loaded and unloaded again and again: every request ends with its own tokens."""
    _, _, paths, expected = setup
    results: list[tuple[str, list[int] | str]] = []

    def worker(model: str) -> None:
        for _ in range(3):
            r = _complete(server, model, timeout=120)
            results.append((model, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=worker, args=(m,)) for m in ("base", "all7", "qv", "all7", "qv", "base")]
    for t in threads:
        t.start()
    for i in range(4):
        name = f"extra{i % 2}"
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths["mlp"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert _tokens(_complete(server, name, timeout=120)) == expected["mlp"]
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60).status_code == 200
    for t in threads:
        t.join()
    assert len(results) == 18
    for model, tokens in results:
        assert tokens == expected[None if model == "base" else model], model


def test_lora_requests_info_as_vllm_exports_it(server):
    _tokens(_complete(server, "qv"))
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for prefix in ("pagoda", "vllm"):
        lines = [line for line in text.splitlines() if line.startswith(f"{prefix}:lora_requests_info{{")]
        assert lines, text
        assert all('max_lora="2"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line
                   for line in lines)
        newest = max(lines, key=lambda line: float(line.rsplit(" ", 1)[1]))
        assert float(newest.rsplit(" ", 1)[1]) > 1.7e9  # a wall-clock timestamp
        assert any('running_lora_adapters="qv"' in line for line in lines), lines
    assert 'pagoda:lora_requests_total{engine="0",lora_name="qv",model_name="base"}' in text
