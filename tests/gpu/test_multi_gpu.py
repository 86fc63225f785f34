"""Pipeline, expert and data parallelism on two GPUs with NCCL (issue 20): PP=2 and TP=2 with
expert parallelism give one GPU's greedy tokens; `pagoda serve --data-parallel-size 2` puts one
engine core on each GPU, answers through one endpoint with one GPU's greedy tokens, and reports
dead (`/health` 503) within 30 s of a rank being killed; with `--enable-expert-parallel` too, the
MoE layers' experts span both cores (NCCL all-gather / reduce-scatter between them, lockstep and
dummy batches), with one GPU's greedy tokens. Skipped with fewer than 2 GPUs."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import gpu_support
from gpu_support import requires_gpu
from pagoda_engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, requires_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))

from pagoda_e2e import free_port, start_pagoda  # noqa: E402
from tests.server.conftest import core_pids  # noqa: E402

PROMPTS = gpu_support.random_prompts(3, [5, 37, 120, 260])
make_llm = functools.partial(gpu_support.make_llm, num_kv_pages=256, max_num_seqs=16)

# Qwen3-MoE at a small size whose experts divide over 2 ranks: 8 experts of 256, 2 per token.
SMALL_MOE_CONFIG = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                        intermediate_size=1024, norm_topk_prob=True, max_position_embeddings=2048,
                        rms_norm_eps=1e-6, rope_theta=1000000.0)


def greedy(llm: LLM) -> list:
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))


def greedy_ids(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in greedy(llm)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, gpu_model_dir):
    import transformers

    out = tmp_path_factory.mktemp("qwen3-moe-small")
    gpu_support.save_random_model(out, gpu_model_dir, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                                  **SMALL_MOE_CONFIG)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pp2_greedy_equals_one_gpu(gpu_model_dir, dtype):
    """Each stage runs its layers' kernels on the same batch as one GPU does: the same choices."""
    kwargs = dict(dtype=dtype, attention_backend="torch" if dtype == "float32" else "auto")
    with make_llm(gpu_model_dir, **kwargs) as one:
        expected = greedy_ids(one)
    with make_llm(gpu_model_dir, pipeline_parallel_size=2, **kwargs) as pp2:
        assert pp2.core.device == torch.device("cuda", 0)
        assert greedy_ids(pp2) == expected


def test_tp2_expert_parallel_float32_greedy_equals_one_gpu(moe_dir):
    kwargs = dict(dtype="float32", attention_backend="torch", max_num_batched_tokens=128)
    with make_llm(moe_dir, **kwargs) as one:
        expected = greedy_ids(one)
    with make_llm(moe_dir, tensor_parallel_size=2, enable_expert_parallel=True, **kwargs) as ep2:
        assert greedy_ids(ep2) == expected


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_dp2_serves_from_both_gpus_and_reports_a_killed_rank(gpu_model_dir, tmp_path):
    """The requests go one at a time, so each decodes alone on its core; one GPU runs them alone
    too (in bf16 a batch of twelve takes other kernels than a lone request: other sums)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with make_llm(gpu_model_dir) as one:
        expected = [one.generate([p], params)[0].outputs[0].text for p in PROMPTS]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_pagoda(["serve", "--model", str(gpu_model_dir), "--host", "127.0.0.1", "--port", str(port),
                         "--data-parallel-size", "2", "--dtype", "bfloat16", "--num-kv-pages", "256",
                         "--max-num-seqs", "16", "--seed", "0"], tmp_path / "dp2.log")
    try:
        proc.wait_http(f"{url}/health", timeout=300)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        got = [_post(f"{url}/v1/completions", {"model": model, "prompt": p, "max_tokens": 24,
                                               "temperature": 0, "ignore_eos": True})
               for p in PROMPTS * 2]
        assert [r["choices"][0]["text"] for r in got] == expected * 2, "DP=2 gave other greedy tokens than one GPU"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        served = {line.split('engine="')[1].split('"')[0] for line in metrics.splitlines()
                  if line.startswith("pagoda:request_success_total") and float(line.rsplit(" ", 1)[1]) > 0}
        assert served == {"0", "1"}, f"requests went to engines {served}"
        # Kill the engine core on the second GPU: /health turns 503 within 30 s.
        pids = core_pids(proc.pid)
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while _health(url) == 200 and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert _health(url) == 503, f"/health not 503 30 s after killing engine core {pids[1]}"
    finally:
        proc.stop()


def _serve(model_dir, tmp_path, name: str, *extra: str):
    port = free_port()
    proc = start_pagoda(["serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                         "--num-kv-pages", "256", "--max-num-seqs", "16", "--seed", "0", *extra], tmp_path / f"{name}.log")
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
    return proc, f"http://127.0.0.1:{port}"


def _post_to_core(url: str, body: dict, rank: int) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dp2_expert_parallel_greedy_equals_one_gpu(moe_dir, tmp_path, dtype):
    """Experts across two cores, one per GPU: requests on one core only (the other runs dummy
    batches), then on both at once. float32 with torch attention is exact; bf16 runs the Triton
    experts and FlashInfer, whose sums depend on the batch: there every request must still finish."""
    import concurrent.futures

    kwargs = dict(dtype=dtype, attention_backend="torch" if dtype == "float32" else "auto", max_num_batched_tokens=128)
    with make_llm(moe_dir, **kwargs) as one:
        expected = [o.outputs[0].text for o in greedy(one)]
    proc, url = _serve(moe_dir, tmp_path, f"dp2-ep-{dtype}", "--data-parallel-size", "2", "--enable-expert-parallel",
                       "--dtype", dtype, "--attention-backend", kwargs["attention_backend"],
                       "--max-num-batched-tokens", "128")
    try:
        def complete(prompt, rank):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            return _post_to_core(f"{url}/v1/completions", body, rank)["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            one_core = list(pool.map(complete, PROMPTS, [1] * len(PROMPTS)))
            both = list(pool.map(complete, PROMPTS, [i % 2 for i in range(len(PROMPTS))]))
        if dtype == "float32":
            assert one_core == expected and both == expected
        else:
            assert all(one_core) and all(both)
    finally:
        proc.stop()
