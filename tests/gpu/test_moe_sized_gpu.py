"""The GPU engine at Qwen3-30B-A3B's shapes: 32 query heads over 4 KV heads of 128 with q/k norm,
128 experts of 768 with 8 per token (Triton routing, alignment and grouped GEMMs), a
151,936-token vocabulary, with two layers instead of 48. bf16 logits against transformers, and
the piecewise CUDA graphs against the eager forward."""

from __future__ import annotations

import pytest

from gpu_support import check_bf16_logits_against, check_piecewise_forward, requires_gpu, save_bf16_with_reference

pytestmark = [pytest.mark.gpu, requires_gpu]

QWEN3_MOE_SIZED_CONFIG = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True,
                              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0)


@pytest.fixture(scope="module")
def moe_sized(tmp_path_factory):
    """(directory, transformers reference): bf16 weights on disk, the same values in float32."""
    import transformers

    config = transformers.Qwen3MoeConfig(bos_token_id=151643, eos_token_id=151645, **QWEN3_MOE_SIZED_CONFIG)
    return save_bf16_with_reference(transformers.Qwen3MoeForCausalLM, config, 0.03,
                                    tmp_path_factory.mktemp("qwen3-moe-sized"))


def test_bf16_logits_match_transformers_at_qwen3_30b_a3b_size(moe_sized):
    check_bf16_logits_against(*moe_sized)


def test_piecewise_forward_matches_the_eager_forward_at_qwen3_30b_a3b_size(moe_sized):
    check_piecewise_forward(moe_sized[0])
