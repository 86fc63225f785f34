"""The GPU engine at Llama-3.1-8B's shapes: 32 query heads over 8 KV heads of 128 (FlashInfer's
FA3 prefill and tensor-core decode at the benchmark's sizes), an MLP of 14,336, a 128,256-token
vocabulary and llama3 rotary, with two layers instead of 32. bf16 logits against transformers,
and the piecewise CUDA graphs against the eager forward. A module of its own, run after the
small model's: its 6 GiB float32 reference is freed when the module ends."""

from __future__ import annotations

import pytest

from gpu_support import (LLAMA_SIZED_CONFIG, check_bf16_logits_against, check_piecewise_forward, requires_gpu,
                         save_bf16_with_reference)

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(scope="module")
def llama_sized(tmp_path_factory):
    """(directory, transformers reference): bf16 weights on disk; the reference holds the same
    values in float32."""
    import transformers

    config = transformers.LlamaConfig(bos_token_id=128000, eos_token_id=128001, **LLAMA_SIZED_CONFIG)
    # std 0.02: about unit gain per projection at hidden size 4096.
    return save_bf16_with_reference(transformers.LlamaForCausalLM, config, 0.02, tmp_path_factory.mktemp("llama-sized"))


def test_bf16_logits_match_transformers_at_llama_size(llama_sized):
    check_bf16_logits_against(*llama_sized)


def test_piecewise_forward_matches_the_eager_forward_at_llama_size(llama_sized):
    check_piecewise_forward(llama_sized[0])
