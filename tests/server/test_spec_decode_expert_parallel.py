"""Speculative decoding with a mixture-of-experts model whose experts span two engine cores
(`pagoda serve --data-parallel-size 2 --enable-expert-parallel --speculative-config`): prompt
lookup, and a draft model (the model drafting for itself, whole on each core's rank 0, its experts
local). Verification steps are one forward of each core's lockstep turn; greedy tokens equal one
process's without speculation, on either core, with both busy at once or one alone (EAGLE-3 on
such cores: `tests/engine/test_spec_eagle3.py`)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from conftest import launch, scrape
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.tiny import build_tiny_model

MAX_TOKENS = 16
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [(3 * i + 1) % 400 + 5 for i in range(30)], [100 + i for i in range(11)], [42] * 9]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3-moe") / "model", arch="qwen3_moe", seed=5)


@pytest.fixture(scope="module")
def one_process_tokens(moe_dir) -> list[list[int]]:
    with LLM(str(moe_dir), num_kv_pages=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def server(moe_dir, tmp_path_factory, request):
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if request.param == "ngram"
            else {"method": "draft_model", "model": str(moe_dir), "num_speculative_tokens": 3})
    srv = launch(tmp_path_factory.mktemp(f"serve-{request.param}"), "--model", str(moe_dir), "--num-kv-pages", "64",
                 "--max-model-len", "256", "--data-parallel-size", "2", "--enable-expert-parallel",
                 "--speculative-config", json.dumps(spec))
    yield srv
    srv.proc.stop()


def _tokens(url: str, prompt: list[int], rank: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", headers={"X-data-parallel-rank": str(rank)}, timeout=120,
                   json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_greedy_tokens_equal_one_process_on_either_core_busy_or_alone(server, one_process_tokens):
    jobs = [(i, rank) for i in range(len(PROMPTS)) for rank in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _tokens(server.url, PROMPTS[job[0]], job[1]), jobs))
    for (i, rank), tokens in zip(jobs, got):
        assert tokens == one_process_tokens[i], (i, rank)
    assert [_tokens(server.url, p, 1) for p in PROMPTS] == one_process_tokens  # core 0 idles meanwhile
    metrics = scrape(server.url, per_engine=True)
    for engine in ("0", "1"):  # each core verified drafts and kept some
        assert metrics.get(f"pagoda:spec_decode_num_accepted_tokens_total{{engine={engine}}}", 0) > 0, metrics

