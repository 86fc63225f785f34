"""What every GPU test module shares: the skip rule (no CUDA or no FlashInfer: skip, as on CPU CI)
and the small model's configuration. A module of its own, not conftest.py, so test modules can
import it by a name no other test directory uses."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from pagoda_engine import LLM

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")

# 8 query heads over 2 KV heads (group 4: the tensor-core decode path), head_dim 64, llama3 rotary.
MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=256))



# Llama-3.1-8B's shapes (32 query heads over 8 KV heads of 128, MLP 14,336, vocabulary 128,256, its
# rotary scaling) with two layers instead of 32: the kernels run at the sizes the benchmarks use.
LLAMA_SIZED_CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=8192))

# What most GPU tests run: bf16, a fixed small KV pool, a batch that covers several graph sizes.
LLM_DEFAULTS = dict(dtype="bfloat16", num_kv_pages=512, max_num_seqs=32, seed=0)


def make_llm(model_dir, **overrides) -> LLM:
    """An engine on the GPU with LLM_DEFAULTS (overridable), after freeing what earlier tests left."""
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(str(model_dir), **{**LLM_DEFAULTS, **overrides})
