"""Greedy generation through the whole engine (scheduler, KV pages, runner, sampler) equals
Hugging Face `generate` on the same tiny random models, under every scheduling condition."""

import pytest
import torch
import transformers

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.tiny import build_tiny_model

NEW_TOKENS = 12
# Prompts of different lengths (token ids), two of them sharing a 40-token prefix.
SHARED = [(7 * i + 11) % 500 + 5 for i in range(40)]
PROMPTS = [
    [5, 6, 7],
    SHARED + [9, 10, 11, 12, 13],
    [(3 * i + 1) % 400 + 5 for i in range(23)],
    SHARED + [44, 45],
    [100 + i for i in range(17)],
]

ARCHS = {
    "llama": {},
    # llama3 rope scaling, tied embeddings.
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "tie_word_embeddings": True},
    "mistral": {},
    "qwen2": {},
    # grouped-query attention with an uneven layout: 6 query heads over 2 KV heads.
    "qwen3": {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16},
    # Mixture of experts (expert counts: the tiny builder's MoE defaults).
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
}


def _arch(name: str) -> str:
    return "llama" if name == "llama3" else name


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request, tmp_path_factory):
    name = request.param
    return build_tiny_model(tmp_path_factory.mktemp(name) / "model", arch=_arch(name), seed=3,
                            config_overrides=ARCHS[name])


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Hugging Face `generate`, greedy, exactly `new_tokens` per prompt (EOS masked): the reference."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def hf_tokens(model_dir):
    return hf_greedy(model_dir, PROMPTS)


def _greedy():
    # min_tokens = max_tokens masks EOS exactly as HF's min_new_tokens does.
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _assert_pool_free(llm: LLM) -> None:
    kv = llm.core.kv
    assert kv.num_free_pages == kv.pool.num_pages - 1, "pages leaked"
    assert not kv.req_pages and not kv.req_hashes
    assert all(p.ref_cnt == 0 for p in kv.pool.pages[1:])


def _generate(model_dir, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), dtype="float32", **kwargs)
    outs = llm.generate(PROMPTS, _greedy())
    return [o.outputs[0].token_ids for o in outs], llm


def test_greedy_equals_hf_generate(model_dir, hf_tokens):
    tokens, llm = _generate(model_dir, num_kv_pages=128)
    assert tokens == hf_tokens
    _assert_pool_free(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [8, 32])
def test_chunked_prefill_and_prefix_caching_keep_greedy_tokens(model_dir, hf_tokens, prefix_caching, budget):
    tokens, llm = _generate(model_dir, num_kv_pages=128, block_size=16, max_num_batched_tokens=budget,
                            enable_prefix_caching=prefix_caching)
    assert tokens == hf_tokens
    if prefix_caching:
        assert llm.core.kv.prefix_hits > 0
    _assert_pool_free(llm)


def test_prefix_cache_hit_on_second_run_gives_same_tokens(model_dir, hf_tokens):
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())]
    hits_before = llm.core.kv.prefix_hits
    second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())]
    assert first == second == hf_tokens
    assert llm.core.kv.prefix_hits > hits_before
    _assert_pool_free(llm)


def test_preemption_by_tiny_pool_keeps_greedy_tokens(model_dir, hf_tokens):
    # 9 usable pages of 4 tokens = 36 tokens: the 5 requests cannot all stay resident. Without
    # the growth reservation they are all admitted, and preemption has to make room.
    tokens, llm = _generate(model_dir, num_kv_pages=16, block_size=4, max_model_len=64, kv_growth_reservation=False)
    assert tokens == hf_tokens
    assert llm.core.scheduler.num_preemptions > 0
    _assert_pool_free(llm)
