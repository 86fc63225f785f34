"""GGUF checkpoints: tiny random Hugging Face models written as llama.cpp writes them (gguf_files.py)
load to the Hugging Face model's logits (Llama's q/k permutation undone, tied and untied
embeddings, Qwen2's biases, Qwen3's q/k norms, and the MoE kinds: Mixtral, Qwen2-MoE's shared
expert, Qwen3-MoE, their experts stacked per projection), quantized files load as transformers
dequantizes them, the offline LLM serves a GGUF file with its own tokenizer and chat template, and
bad files are clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter

from gguf_files import write_gguf
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.api.tokenizer import apply_chat_template, load_tokenizer
from pagoda_engine.errors import ModelLoadError, UnsupportedArchitectureError
from pagoda_engine.model_path import TINY_MODEL_NAME, resolve_model_path
from pagoda_engine.worker.model.loader import load_hf_config, load_model
from random_weights import randomise
from test_model_vs_hf import BASE, CPU, PagedRunner, assert_logits_close, reference_logits
from test_model_vs_hf import CASES as HF_CASES


def _moe_sizes_for_q8(case: str, **overrides):
    """test_model_vs_hf's MoE case with expert sizes that are multiples of 32 (Q8_0 blocks fit their rows)."""
    config_cls, model_cls, base = HF_CASES[case]
    return config_cls, model_cls, {**base, "moe_intermediate_size": 64, **overrides}


# name → (config class, model class, overrides): GQA 6 over 2 and plain multi-head Llama (the q/k
# permutation with each head count), tied and untied embeddings, Qwen2's q/k/v bias, Qwen3's q/k norm.
CASES = {
    "llama_gqa6over2": ("LlamaConfig", "LlamaForCausalLM",
                        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM",
                        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # Rope scaling in its three GGUF forms: Llama 3.1's (a rope_freqs tensor), linear and YaRN
    # (metadata). Original contexts short enough that the prompts' positions reach the scaling.
    "llama31_rope_freqs": ("LlamaConfig", "LlamaForCausalLM",
                           dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling=dict(rope_type="linear",
                                                                                                factor=2.0))),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    # Mixture of experts, as in test_model_vs_hf, routed as llama.cpp routes each: Mixtral (a llama
    # file with experts), Qwen2-MoE (gated shared expert, not renormalised; every layer with
    # experts, as llama.cpp's files have them), Qwen3-MoE (renormalised).
    "mixtral_moe": HF_CASES["mixtral_moe"],
    "qwen2_moe_shared_expert": _moe_sizes_for_q8("qwen2_moe_shared_expert", shared_expert_intermediate_size=96,
                                                 mlp_only_layers=[]),
    "qwen3_moe_normalised": _moe_sizes_for_q8("qwen3_moe_normalised"),
}
MOE_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob")
PROMPT_LENGTHS = (1, 6, 29)


def random_hf_model(case: str, **config_overrides):
    config_cls, model_cls, overrides = CASES[case]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides, **config_overrides})
    torch.manual_seed(sum(map(ord, case)))
    model = getattr(transformers, model_cls)(config)
    randomise(model, std=0.15, norm_spread=0.3)
    return model.eval()


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def pagoda_logits(model_path, tokens_list: list[list[int]]) -> list[torch.Tensor]:
    ours = load_model(str(model_path), load_hf_config(str(model_path)), torch.float32, CPU)
    return PagedRunner(ours, page_size=4).step([(f"r{i}", t) for i, t in enumerate(tokens_list)])


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_file_loads_to_the_hf_model_s_logits(case, tmp_path):
    hf = random_hf_model(case)
    path = write_gguf(hf, tmp_path / f"{case}.gguf")
    config = load_hf_config(str(path))
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(hf.config, field), field
    for field in MOE_FIELDS:
        assert getattr(config, field, None) == getattr(hf.config, field, None), field
    if hf.config.rope_parameters["rope_type"] in ("linear", "yarn"):
        assert config.rope_parameters == hf.config.rope_parameters
    assert config.model_type == hf.config.model_type
    token_lists = prompts(hf.config.vocab_size)
    for got, tokens in zip(pagoda_logits(path, token_lists), token_lists):
        assert_logits_close(got, reference_logits(hf, tokens))


def test_quantized_gguf_loads_as_transformers_dequantizes_it(tmp_path):
    hf = random_hf_model("llama_gqa6over2")
    path = write_gguf(hf, tmp_path / "q8.gguf", quantization=GGMLQuantizationType.Q8_0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    token_lists = prompts(hf.config.vocab_size)
    for got, tokens in zip(pagoda_logits(path, token_lists), token_lists):
        assert_logits_close(got, reference_logits(reference, tokens))
    # Quantization changed the model: the comparison above is with the dequantized weights.
    assert not torch.allclose(reference_logits(hf, token_lists[-1]), reference_logits(reference, token_lists[-1]))


def test_a_mixtral_gguf_file_in_llama_cpp_s_first_per_expert_layout_loads(tmp_path):
    """Mixtral files converted before llama.cpp stacked the experts: `blk.<l>.ffn_gate.<e>.weight`."""
    hf = random_hf_model("mixtral_moe")
    path = write_gguf(hf, tmp_path / "mixtral.gguf", per_expert=True)
    assert load_hf_config(str(path)).num_local_experts == 4
    token_lists = prompts(hf.config.vocab_size)
    for got, tokens in zip(pagoda_logits(path, token_lists), token_lists):
        assert_logits_close(got, reference_logits(hf, tokens))


@pytest.mark.parametrize("case", ["mixtral_moe", "qwen2_moe_shared_expert", "qwen3_moe_normalised"])
def test_quantized_moe_gguf_loads_as_its_weights_round_through_the_quantization(case, tmp_path):
    """Stacked experts quantized as llama.cpp quantizes them (row blocks), split per expert on load.
    The reference is the model with every matrix the file quantizes rounded through Q8_0
    (transformers' GGUF loader reads no MoE file: it builds Mixtral as dense Llama and refuses
    Qwen-MoE's expert shapes)."""
    from gguf import dequantize, quantize

    hf = random_hf_model(case)
    path = write_gguf(hf, tmp_path / "q8.gguf", quantization=GGMLQuantizationType.Q8_0)
    token_lists = prompts(hf.config.vocab_size)
    unquantized = reference_logits(hf, token_lists[-1])
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.ndim >= 2 and not name.endswith("shared_expert_gate.weight"):  # a vector in the file
                rounded = dequantize(quantize(param.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(rounded.reshape(param.shape)))
    for got, tokens in zip(pagoda_logits(path, token_lists), token_lists):
        assert_logits_close(got, reference_logits(hf, tokens))
    assert not torch.allclose(unquantized, reference_logits(hf, token_lists[-1]))


@pytest.fixture(scope="module")
def tiny_tokenizer_dir():
    return Path(resolve_model_path(TINY_MODEL_NAME))


@pytest.mark.parametrize("case", ["llama_gqa6over2", "qwen3_moe_normalised"])
def test_offline_llm_serves_a_gguf_file_with_its_tokenizer_and_chat_template(case, tiny_tokenizer_dir, tmp_path):
    hf_tokenizer = load_tokenizer(tiny_tokenizer_dir)
    hf = random_hf_model(case, vocab_size=len(hf_tokenizer))
    path = write_gguf(hf, tmp_path / "chat.gguf", tokenizer_dir=tiny_tokenizer_dir)
    texts = ["The capital of France is", "Once upon a time, ünïcödé 🙂", "1 2 3"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), num_kv_pages=64) as llm:
        assert [llm.tokenizer.encode(t) for t in texts] == [hf_tokenizer.encode(t) for t in texts]
        conversation = [{"role": "user", "content": "Hello"}]
        assert (apply_chat_template(llm.tokenizer, conversation)
                == apply_chat_template(hf_tokenizer, conversation))
        outputs = llm.generate(texts, greedy)
    for text, out in zip(texts, outputs):
        ids = torch.tensor([hf_tokenizer.encode(text)])
        want = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:].tolist()
        assert list(out.outputs[0].token_ids) == want, text


def test_a_quantized_moe_gguf_file_gives_the_same_tokens_on_two_expert_parallel_ranks(tiny_tokenizer_dir, tmp_path):
    """Each rank (two gloo processes) keeps half of the experts it dequantizes from the stacked
    tensors, and the shared expert's columns."""
    hf = random_hf_model("qwen2_moe_shared_expert", vocab_size=len(load_tokenizer(tiny_tokenizer_dir)))
    path = write_gguf(hf, tmp_path / "moe.gguf", tokenizer_dir=tiny_tokenizer_dir,
                      quantization=GGMLQuantizationType.Q8_0)
    token_lists = prompts(hf.config.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    tokens = {}
    for ranks in (1, 2):
        with LLM(str(path), tensor_parallel_size=ranks, enable_expert_parallel=ranks > 1, num_kv_pages=64) as llm:
            tokens[ranks] = [o.outputs[0].token_ids for o in llm.generate(token_lists, greedy)]
    assert tokens[2] == tokens[1] and all(len(t) == 8 for t in tokens[1])


def test_a_directory_holding_one_gguf_file_loads_it(tmp_path):
    hf = random_hf_model("qwen2_bias_tied")
    write_gguf(hf, tmp_path / "model.gguf")
    assert load_hf_config(str(tmp_path)).num_attention_heads == 4
    token_lists = prompts(hf.config.vocab_size)
    assert_logits_close(pagoda_logits(tmp_path, token_lists)[0], reference_logits(hf, token_lists[0]))
    write_gguf(hf, tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files .*model.gguf, other.gguf"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncated_data", "truncated_header", "not_gguf"])
def test_a_damaged_gguf_file_is_a_model_load_error(damage, tmp_path):
    path = write_gguf(random_hf_model("llama_tied"), tmp_path / "model.gguf")
    data = path.read_bytes()
    path.write_bytes({"truncated_data": data[: len(data) * 2 // 3], "truncated_header": data[:40],
                      "not_gguf": b"PK\x03\x04" + data[4:]}[damage])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file, or truncated"):
        load_hf_config(str(path))


def test_an_architecture_pagoda_does_not_serve_is_refused_by_name(tmp_path):
    writer = GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' GGUF model; Pagoda loads GGUF files of llama"):
        load_hf_config(str(tmp_path / "gpt2.gguf"))


def _moe_metadata_file(path: Path, expert_count: int, used: int, layers_with_experts: int,
                       weights_scale: float | None = None) -> Path:
    """A two-layer qwen3moe GGUF file with this expert metadata and stacked experts in the first
    `layers_with_experts` layers (no other tensors: the config is read before the weights)."""
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_vocab_size(128)
    writer.add_expert_count(expert_count)
    writer.add_expert_used_count(used)
    if weights_scale is not None:
        writer.add_expert_weights_scale(weights_scale)
    for layer in range(layers_with_experts):
        writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.zeros((expert_count, 32, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("metadata,reason", [
    (dict(expert_count=4, used=0, layers_with_experts=2), "4 experts, 0 used per token"),
    (dict(expert_count=4, used=8, layers_with_experts=2), "4 experts, 8 used per token"),
    (dict(expert_count=4, used=2, layers_with_experts=1), "experts in 1 of 2 layers"),
    (dict(expert_count=4, used=2, layers_with_experts=2, weights_scale=2.5), "expert_weights_scale = 2.5"),
], ids=["none-used", "more-used-than-there-are", "a-layer-without-experts", "scaled-weights"])
def test_moe_gguf_metadata_pagoda_cannot_serve_is_a_model_load_error(metadata, reason, tmp_path):
    path = _moe_metadata_file(tmp_path / "moe.gguf", **metadata)
    with pytest.raises(ModelLoadError, match=reason):
        load_hf_config(str(path))


@pytest.mark.parametrize("scaling,reason", [
    (dict(kind="longrope", factor=4.0), "scaling 'longrope'"),
    (dict(kind="yarn", factor=4.0, attn_factor=0.8), "yarn_attn_factor"),
    (dict(kind="linear"), "factor None"),
], ids=["longrope", "yarn-attention-factor", "linear-without-factor"])
def test_rope_scaling_pagoda_cannot_apply_is_a_model_load_error(scaling, reason, tmp_path):
    writer = GGUFWriter(str(tmp_path / "rope.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_vocab_size(128)
    writer.add_string("llama.rope.scaling.type", scaling["kind"])
    if "factor" in scaling:
        writer.add_rope_scaling_factor(scaling["factor"])
    if "attn_factor" in scaling:
        writer.add_float32("llama.rope.scaling.yarn_attn_factor", scaling["attn_factor"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=reason):
        load_hf_config(str(tmp_path / "rope.gguf"))


def test_rope_frequency_factors_of_the_wrong_length_are_a_model_load_error(tmp_path):
    hf = random_hf_model("llama31_rope_freqs")
    path = write_gguf(hf, tmp_path / "model.gguf")
    config = load_hf_config(str(path))
    assert len(config.rope_freq_factors) == 8  # head_dim 16 / 2
    config.rope_freq_factors = config.rope_freq_factors[:5]
    with pytest.raises(ModelLoadError, match="5 given \\(head_dim 16 needs 8\\)"):
        load_model(str(path), config, torch.float32, CPU)


def test_pagoda_serve_with_a_truncated_gguf_exits_1_with_the_reason(tmp_path):
    path = write_gguf(random_hf_model("llama_tied"), tmp_path / "model.gguf")
    path.write_bytes(path.read_bytes()[:1000])
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--host", "127.0.0.1", "--port", "9",
                          "--model", str(path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert "the engine could not start" in out.stderr and "not a valid GGUF file, or truncated" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_a_gguf_tokenizer_is_cached_and_the_cached_one_is_the_same(tiny_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    hf_tokenizer = load_tokenizer(tiny_tokenizer_dir)
    path = write_gguf(random_hf_model("llama_tied", vocab_size=len(hf_tokenizer)), tmp_path / "m.gguf",
                      tokenizer_dir=tiny_tokenizer_dir)
    built, cached = load_tokenizer(path), load_tokenizer(path)
    [entry] = (tmp_path / "cache" / "gguf-tokenizers-v2").iterdir()
    assert entry.name.startswith("m-") and cached.name_or_path == str(entry)
    texts = ["Once upon a time, ünïcödé 🙂", "<|im_start|>user\nhi<|im_end|>"]
    assert [cached.encode(t) for t in texts] == [built.encode(t) for t in texts] == [hf_tokenizer.encode(t) for t in texts]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert apply_chat_template(cached, conversation) == apply_chat_template(built, conversation)
    assert cached.eos_token_id == built.eos_token_id and cached.bos_token_id == built.bos_token_id


def test_a_gguf_tokenizer_whose_saved_copy_loads_differently_is_not_cached(tiny_tokenizer_dir, tmp_path, monkeypatch):
    """A Qwen2-architecture GGUF: transformers' Qwen2 tokenizer, loaded back from a saved copy,
    rebuilds its pre-tokenizer from the class's defaults (digits one by one) instead of the file's:
    such a tokenizer is converted from the file every time, never served from the cache."""
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    hf_tokenizer = load_tokenizer(tiny_tokenizer_dir)
    path = write_gguf(random_hf_model("qwen3_moe_normalised", vocab_size=len(hf_tokenizer)), tmp_path / "q.gguf",
                      tokenizer_dir=tiny_tokenizer_dir)
    first, second = load_tokenizer(path), load_tokenizer(path)
    assert not any((tmp_path / "cache" / "gguf-tokenizers-v2").glob("q-*"))
    texts = ["1 2 3", "Once upon a time, ünïcödé 🙂"]
    assert [second.encode(t) for t in texts] == [first.encode(t) for t in texts] == [hf_tokenizer.encode(t) for t in texts]
