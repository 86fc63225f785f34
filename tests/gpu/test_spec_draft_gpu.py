"""Speculative decoding with a drafting model on the GPU (FlashInfer, CUDA graphs for the target's
decodes, async scheduling): `draft_model` (the target as its own draft, and a random one-layer
draft) and `eagle3` (a random EAGLE-3 head over a six-layer target) write the greedy tokens of
decoding without speculation (a token may differ only at a tie within bf16 rounding), with
chunked prefill and preemption, and leave no pages behind."""

from __future__ import annotations

import pytest
import transformers

from eagle3_heads import write_eagle3_head
from gpu_support import MODEL_CONFIG, make_llm, random_prompts, requires_gpu, save_random_model
from pagoda_engine import SamplingParams
from test_spec_decode_gpu import _assert_same_or_tie

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, gpu_model_dir):
    out = tmp_path_factory.mktemp("gpu-draft")
    save_random_model(out, gpu_model_dir, transformers.LlamaForCausalLM, transformers.LlamaConfig,
                      **{**MODEL_CONFIG, "num_hidden_layers": 1})
    return out


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, gpu_model_dir):
    """Six layers: an EAGLE-3 head reads the hidden states entering layers 2, 3 and 3."""
    out = tmp_path_factory.mktemp("gpu-llama6")
    save_random_model(out, gpu_model_dir, transformers.LlamaForCausalLM, transformers.LlamaConfig,
                      **{**MODEL_CONFIG, "num_hidden_layers": 6})
    return out


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, deep_model_dir):
    # head_dim 64, as the target's: FlashInfer's precompiled kernels serve it.
    return write_eagle3_head(tmp_path_factory.mktemp("gpu-eagle3") / "head", deep_model_dir, 256, seed=2,
                             hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024)


ENGINES = [
    dict(max_num_batched_tokens=64),
    dict(num_kv_pages=10, block_size=16, max_model_len=256, kv_growth_reservation=False),
]


def _run_both(model_dir, speculative_config, engine_kwargs):
    prompts = random_prompts(11, [5, 9, 13, 3, 20, 7, 40])
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    results, stats = [], None
    for config in (None, speculative_config):
        llm = make_llm(model_dir, speculative_config=config, **engine_kwargs)
        assert llm.core.cuda_graphs
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        kv = llm.core.kv
        assert kv.num_free_pages == kv.pool.num_pages - 1, "pages leaked"
        if "num_kv_pages" in engine_kwargs:
            assert llm.core.scheduler.num_preemptions > 0
        if config is not None:
            stats = llm.core.scheduler.spec.stats
    _assert_same_or_tie(*results)
    assert stats.num_drafts > 0
    return stats


@pytest.mark.parametrize("engine_kwargs", ENGINES)
def test_draft_model_greedy_tokens_equal_decoding_without_speculation(gpu_model_dir, draft_dir, engine_kwargs):
    _run_both(gpu_model_dir, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
              engine_kwargs)


def test_the_target_as_its_own_draft_keeps_its_drafts(gpu_model_dir):
    stats = _run_both(gpu_model_dir, {"method": "draft_model", "model": str(gpu_model_dir),
                                      "num_speculative_tokens": 4}, ENGINES[0])
    # bf16: the drafting forward and the verification sum in other orders, so a tie may part them.
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens, stats


@pytest.mark.parametrize("engine_kwargs", ENGINES)
def test_eagle3_greedy_tokens_equal_decoding_without_speculation(deep_model_dir, head_dir, engine_kwargs):
    _run_both(deep_model_dir, {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3},
              engine_kwargs)
