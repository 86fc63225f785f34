"""LoRA adapters on a mixture-of-experts model whose experts span two engine cores (`pagoda serve
--data-parallel-size 2 --enable-expert-parallel --enable-lora`): an adapter of the attention's
projections (an MoE layer's experts take none) gives PEFT's greedy tokens on either core, with
the base model's requests and the adapter's running at once, pinned to each core in turn, while
the cores step in lockstep through the experts' all-to-all."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

pytest.importorskip("peft")

from lora_adapters import peft_greedy, write_adapter  # noqa: E402

from conftest import launch  # noqa: E402
from pagoda_engine.tiny import build_tiny_model  # noqa: E402

NEW_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9], [100 + i for i in range(12)], [7, 7, 7]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-ep")
    model_dir = build_tiny_model(root / "model", arch="qwen3_moe", seed=5)
    adapter = write_adapter(model_dir, root / "qv", 4, 8, True, ["q_proj", "v_proj"], seed=1)
    expected = {"qv": peft_greedy(model_dir, adapter, PROMPTS, NEW_TOKENS),
                str(model_dir): peft_greedy(model_dir, None, PROMPTS, NEW_TOKENS)}
    assert expected["qv"] != expected[str(model_dir)]  # the adapter changes the tokens
    srv = launch(root, "--model", str(model_dir), "--dtype", "float32", "--num-kv-pages", "128",
                 "--max-model-len", "256", "--data-parallel-size", "2", "--enable-expert-parallel", "--enable-lora",
                 "--lora-modules", f"qv={adapter}", "--max-lora-rank", "8")
    yield srv, expected
    srv.proc.stop()


def _tokens(url: str, model: str, prompt: list[int], rank: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", headers={"X-data-parallel-rank": str(rank)}, timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                         "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_the_adapter_and_the_base_give_pefts_tokens_on_either_core_at_once(setup):
    srv, expected = setup
    jobs = [(model, i, rank) for model in expected for i in range(len(PROMPTS)) for rank in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _tokens(srv.url, job[0], PROMPTS[job[1]], job[2]), jobs))
    for (model, i, rank), tokens in zip(jobs, got):
        assert tokens == expected[model][i], (model, i, rank)
    # One core alone under the adapter while the other idles (its dummy steps take no adapter).
    assert [_tokens(srv.url, "qv", p, 1) for p in PROMPTS] == expected["qv"]
