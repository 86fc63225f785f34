"""Experts across two data-parallel engine cores, one per GPU (issue 48), through `pagoda serve`:
the all-to-all dispatch (`--all2all-backend alltoallv`) and EPLB (`--enable-eplb`, re-placing the
experts every 8 forwards) give one GPU's greedy tokens in float32 (torch attention: decode steps
padded to a common size and run eagerly, the padding logic the graphs replay); in bf16 the cores
capture decode graphs and replay them at the padded size every core agrees on, with requests on
one core (the other replaying dummy batches) and on both. Skipped with fewer than 2 GPUs.

bf16's Triton experts sum in an order that depends on how many rows they run (the all-gather
runs both cores' rows), so bf16 is held to one GPU's tokens for most prompts, not all; float32 is
exact."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import pytest
import torch

import gpu_support
from gpu_support import requires_gpu
from pagoda_engine import SamplingParams

pytestmark = [pytest.mark.gpu, requires_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

from test_multi_gpu import SMALL_MOE_CONFIG, _post_to_core, _serve  # noqa: E402

PROMPTS = gpu_support.random_prompts(7, [5, 37, 120, 260, 9, 64])
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, gpu_model_dir):
    import transformers

    out = tmp_path_factory.mktemp("qwen3-moe-small")
    gpu_support.save_random_model(out, gpu_model_dir, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                                  **SMALL_MOE_CONFIG)
    return out


def _one_gpu(moe_dir, dtype: str, attention: str) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with gpu_support.make_llm(moe_dir, num_kv_pages=256, max_num_seqs=16, dtype=dtype, attention_backend=attention,
                              max_num_batched_tokens=128) as one:
        return [o.outputs[0].text for o in one.generate(PROMPTS, params)]


def _one_core_then_both(url: str) -> tuple[list[str], list[str]]:
    def complete(prompt, rank):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        return _post_to_core(f"{url}/v1/completions", body, rank)["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        one_core = list(pool.map(complete, PROMPTS, [1] * len(PROMPTS)))
        both = list(pool.map(complete, PROMPTS, [i % 2 for i in range(len(PROMPTS))]))
    return one_core, both


def _expert_tokens(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.startswith("pagoda:moe_expert_tokens_total{"))


@pytest.mark.parametrize("extra", [["--all2all-backend", "alltoallv"],
                                   ["--enable-eplb", "--eplb-config",
                                    json.dumps({"num_redundant_experts": 2, "window_size": 8, "step_interval": 8})]],
                         ids=["alltoallv", "eplb"])
def test_dp2_ep_float32_greedy_equals_one_gpu(moe_dir, tmp_path, extra):
    expected = _one_gpu(moe_dir, "float32", "torch")
    proc, url = _serve(moe_dir, tmp_path, "dp2-ep-" + extra[0].strip("-"), "--data-parallel-size", "2",
                       "--enable-expert-parallel", "--dtype", "float32", "--attention-backend", "torch",
                       "--max-num-batched-tokens", "128", *extra)
    try:
        one_core, both = _one_core_then_both(url)
        assert one_core == expected and both == expected
    finally:
        proc.stop()


def test_dp2_ep_bf16_replays_padded_decode_graphs(moe_dir, tmp_path):
    expected = _one_gpu(moe_dir, "bfloat16", "auto")
    proc, url = _serve(moe_dir, tmp_path, "dp2-ep-graphs", "--data-parallel-size", "2", "--enable-expert-parallel",
                       "--cudagraph-mode", "FULL_DECODE_ONLY", "--max-num-batched-tokens", "128")
    try:
        one_core, both = _one_core_then_both(url)
        log = (tmp_path / "dp2-ep-graphs.log").read_text()
        assert log.count("captured CUDA graphs") >= 2, "each core captures its decode graphs"
        assert "CUDA graphs are off" not in log
        for got in (one_core, both):
            assert all(got)
            same = sum(a == b for a, b in zip(got, expected))
            assert same >= len(PROMPTS) - 1, (same, got, expected)
        time.sleep(5.5)  # the experts' load is read every 5 s: one more request after it
        _one_core_then_both(url)
        assert _expert_tokens(url) > 0
    finally:
        proc.stop()
