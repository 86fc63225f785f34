"""Qwen3 and Qwen3-MoE on the GPU, whose per-head q/k norms run inside the rotary + K/V-write
kernel (`attention/rope_kv_triton.py`): greedy tokens against transformers through FlashInfer and
both kinds of CUDA graph, the piecewise graphs against the eager forward, and the norm kernels a
forward launches: as many as a Llama of as many layers launches (no q/k norm kernels of their own).

Small bf16 models (8 query heads over 2 KV heads of 64). The MoE one routes every token to all
4 of its experts: bf16 rounding then cannot flip a routing choice (tiny random routers tie often),
so its greedy tokens can be held to transformers' as the dense model's are; its expert kernels
still run.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gpu_support import (CUDA, check_greedy_tokens_against, check_piecewise_forward, make_llm, random_prompts,
                         requires_gpu, save_random_model, triton_compiles_after_start_up)
from pagoda_engine.worker.attention import AttentionBatch, get_attention_backend

pytestmark = [pytest.mark.gpu, requires_gpu]

QWEN3_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
                    rope_theta=1000000.0)
QWEN3_MOE_CONFIG = dict(QWEN3_CONFIG, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=256,
                        norm_topk_prob=True)
MODELS = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config", QWEN3_CONFIG),
          "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE_CONFIG)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def qwen3(request, tmp_path_factory, gpu_model_dir):
    """(directory, transformers reference in float32 on the GPU): bf16 weights with the tiny
    model's tokenizer."""
    import transformers

    model_cls, config_cls, config = MODELS[request.param]
    model_cls = getattr(transformers, model_cls)
    out = tmp_path_factory.mktemp(request.param)
    save_random_model(out, gpu_model_dir, model_cls, getattr(transformers, config_cls), **config)
    return out, model_cls.from_pretrained(out, dtype=torch.float32).to(CUDA).eval()


def test_greedy_tokens_match_transformers_with_the_fused_qk_norm(qwen3):
    """Prefill steps replay piecewise graphs (under 256 tokens), decodes the decode graphs; both
    run the fused kernel with the layers' norms."""
    model_dir, reference = qwen3
    with make_llm(model_dir) as llm:
        assert llm.core.executor.attn.name == "flashinfer"
        assert llm.core.executor.graphs is not None and llm.core.executor.piecewise is not None
        check_greedy_tokens_against(llm, reference, random_prompts(2, [5, 33, 64, 100]))


def test_piecewise_forward_matches_the_eager_forward(qwen3):
    check_piecewise_forward(qwen3[0])


def _kernel_launches(model_dir) -> Counter:
    """Kernels one eager bf16 forward of a 16-token prompt launches, by kind ("norm": any RMSNorm
    kernel, "rope_kv": the fused rotary + K/V write)."""
    from torch.profiler import ProfilerActivity, profile

    from pagoda_engine.worker.model.loader import load_hf_config, load_model

    model = load_model(str(model_dir), load_hf_config(str(model_dir)), torch.bfloat16, CUDA)
    attn = get_attention_backend("auto", model.kv_cache_spec(16, torch.bfloat16), 4, CUDA)
    attn.plan(AttentionBatch(query_lens=[16], seq_lens=[16], page_tables=[[1]],
                             slot_mapping=torch.arange(16, 32, device=CUDA)))
    ids = torch.tensor(random_prompts(0, [16])[0], device=CUDA)
    positions = torch.arange(16, device=CUDA)
    with torch.inference_mode():
        model(ids, positions, attn)  # Triton compiles outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids, positions, attn)
            torch.cuda.synchronize()
    kernels = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return Counter("norm" if "rmsnorm" in name else "rope_kv" if "rope_kv_write" in name else "other"
                   for name in kernels)


def test_qk_norms_launch_no_kernels_of_their_own(qwen3, gpu_model_dir):
    """A Qwen3 layer launches the same RMSNorm kernels as a Llama layer (input and post-attention
    norms): its q and k norms run inside the one rotary + K/V-write launch per layer."""
    qwen3_launches, llama_launches = _kernel_launches(qwen3[0]), _kernel_launches(gpu_model_dir)
    layers = QWEN3_CONFIG["num_hidden_layers"]
    assert qwen3_launches["rope_kv"] == llama_launches["rope_kv"] == layers
    assert qwen3_launches["norm"] == llama_launches["norm"] > 0


def test_no_triton_kernel_is_compiled_after_start_up(qwen3):
    """The fused q/k-norm variant of the rotary kernel and, for the MoE model, the expert kernels
    (sorting, grouped GEMMs, the matrix-vector ones of a few tokens) included."""
    assert triton_compiles_after_start_up(qwen3[0]) == []
