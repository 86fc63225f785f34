"""The GPU tests' fixture: a small bf16 Llama model directory (see gpu_support for the skip rule).

Every test here is marked `gpu` and skips cleanly where there is no CUDA device or no FlashInfer
(CPU CI). The model has head_dim 64 and bf16 weights, so FlashInfer's precompiled kernels serve it,
and weights larger than transformers' default init, so greedy choices are clear rather than ties.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from gpu_support import MODEL_CONFIG
from random_weights import randomise


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory):
    """A bf16 Llama directory (weights, config, the tiny model's tokenizer)."""
    import transformers

    from pagoda_engine.tiny import build_tiny_model

    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    out = tmp_path_factory.mktemp("gpu-llama")
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    vocab = transformers.AutoConfig.from_pretrained(tiny).vocab_size
    config = transformers.LlamaConfig(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                      **MODEL_CONFIG)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomise(model, std=0.06)
    model.to(torch.bfloat16).save_pretrained(out)
    return out
