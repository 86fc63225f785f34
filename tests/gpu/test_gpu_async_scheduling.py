"""Async scheduling on the GPU (FlashInfer, decode CUDA graphs, FlashInfer sampling): the same
greedy and seeded tokens as the synchronous engine, with chunked prefill and preemption."""

from __future__ import annotations

import pytest

from gpu_support import requires_gpu
from pagoda_engine import SamplingParams
from test_gpu_engine import make_llm, random_prompts

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("engine_kwargs", [
    dict(max_num_batched_tokens=64),  # chunked prefill beside graph-replayed decodes
    # preemption (9 pages, 144 tokens; admitted without the growth reservation)
    dict(num_kv_pages=10, block_size=16, max_model_len=256, kv_growth_reservation=False),
])
def test_async_scheduling_gives_the_synchronous_tokens(gpu_model_dir, engine_kwargs):
    prompts = random_prompts(5, [3, 70, 17, 130, 1, 45, 33, 90])
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=2, top_k=20, top_p=0.9, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=3)] * 2
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(gpu_model_dir, async_scheduling=async_scheduling, **engine_kwargs)
        assert llm.core.runner.graphs is not None
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        kv = llm.core.kv
        assert kv.num_free_pages == kv.pool.num_pages - 1, "pages leaked"
        if "num_kv_pages" in engine_kwargs:
            assert llm.core.scheduler.num_preemptions > 0
    assert results[1] == results[0]
