"""The loader: config checks with typed errors, dtype choice, safetensors (single, sharded, half
precision), tied embeddings, dummy weights, and clear errors for missing or unexpected weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

from pagoda_engine.errors import ModelLoadError, UnsupportedArchitectureError
from pagoda_engine.worker.model.loader import load_hf_config, load_model, resolve_dtype

CPU = torch.device("cpu")


def tiny_llama(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def assert_weights_equal(ours: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor sits, converted to float32, where Pagoda's model keeps it."""
    params = dict(ours.named_parameters())
    for i in range(ours.config.num_hidden_layers):
        pre = f"model.layers.{i}"
        attn, mlp = f"{pre}.self_attn", f"{pre}.mlp"
        expected = {
            f"{attn}.qkv_proj.weight": torch.cat([hf_state[f"{attn}.{n}_proj.weight"] for n in "qkv"]),
            f"{attn}.o_proj.weight": hf_state[f"{attn}.o_proj.weight"],
            f"{mlp}.gate_up_proj.weight": torch.cat([hf_state[f"{mlp}.gate_proj.weight"], hf_state[f"{mlp}.up_proj.weight"]]),
            f"{mlp}.down_proj.weight": hf_state[f"{mlp}.down_proj.weight"],
            f"{pre}.input_layernorm.weight": hf_state[f"{pre}.input_layernorm.weight"],
            f"{pre}.post_attention_layernorm.weight": hf_state[f"{pre}.post_attention_layernorm.weight"],
        }
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor.float()), name
    assert torch.equal(params["model.embed_tokens.weight"], hf_state["model.embed_tokens.weight"].float())
    assert torch.equal(params["model.norm.weight"], hf_state["model.norm.weight"].float())
    lm_head = hf_state.get("lm_head.weight", hf_state["model.embed_tokens.weight"])
    assert torch.equal(ours.lm_head.weight, lm_head.float())


def load(model_dir, **kwargs):
    return load_model(str(model_dir), load_hf_config(str(model_dir)), kwargs.pop("dtype", torch.float32), CPU, **kwargs)


def test_single_file_checkpoint_loads_every_weight(tmp_path):
    hf = tiny_llama()
    hf.save_pretrained(tmp_path)
    ours = load(tmp_path)
    assert_weights_equal(ours, hf.state_dict())
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in ours.parameters())
    assert ours.vocab_size == 128 and ours.max_position_embeddings == 64


def test_sharded_checkpoint_loads_across_shards(tmp_path):
    hf = tiny_llama()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    assert_weights_equal(load(tmp_path), hf.state_dict())


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_is_converted_to_the_compute_dtype(tmp_path, stored):
    hf = tiny_llama().to(stored)
    hf.save_pretrained(tmp_path)
    assert load_file(tmp_path / "model.safetensors")["lm_head.weight"].dtype == stored
    ours = load(tmp_path, dtype=torch.float32)
    assert_weights_equal(ours, hf.state_dict())
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


def test_tied_embeddings_share_one_tensor(tmp_path):
    hf = tiny_llama(tie=True)
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    ours = load(tmp_path)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert_weights_equal(ours, hf.state_dict())


def test_dummy_weights_are_deterministic_for_a_seed_and_need_only_config(tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)  # config.json alone, no weights
    assert not list(tmp_path.glob("*.safetensors"))
    a, b, c = (load(tmp_path, load_format="dummy", seed=s) for s in (7, 7, 8))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.qkv_proj.weight"], sc["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(48))
    w = sa["model.layers.1.mlp.down_proj.weight"]
    assert 0.015 < w.std().item() < 0.025
    # Sane logits: finite and small, not a blow-up.
    logits = a.compute_logits(a.model.embed_tokens(torch.arange(5)))
    assert torch.isfinite(logits).all() and logits.abs().max() < 1


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope"))


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_hf_config(str(tmp_path))


def test_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json"):
        load_hf_config(str(tmp_path))


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_hf_config(str(tmp_path))
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


@pytest.mark.parametrize("dropped", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                     "lm_head.weight"])
def test_checkpoint_missing_a_weight_names_it(tmp_path, dropped):
    tiny_llama().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"lacks 1 weights: {dropped}"):
        load(tmp_path)


def test_checkpoint_with_an_unknown_weight_names_it(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old exports: skipped
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.ones(4, 4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"1 weights the model does not use: model\.layers\.0\.mlp\.extra_proj"):
        load(tmp_path)


@pytest.mark.parametrize("name, shape", [("model.layers.1.mlp.down_proj.weight", (48, 65)),  # too wide
                                         ("model.layers.0.self_attn.k_proj.weight", (24, 48)),  # 3 KV heads, not 2
                                         ("model.layers.0.mlp.up_proj.weight", (64, 47))])
def test_weight_of_the_wrong_shape_is_named(tmp_path, name, shape):
    tiny_llama().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors[name] = torch.ones(shape)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{name}: weight of shape {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")):
        load(tmp_path)


def test_directory_without_weights_needs_dummy_format(tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load(tmp_path)
    with pytest.raises(ModelLoadError, match="load_format must be one of"):
        load(tmp_path, load_format="pt")


def test_resolve_dtype():
    config = tiny_llama().config
    config.dtype = torch.bfloat16
    assert resolve_dtype("auto", config, CPU) == torch.float32
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    config.dtype = torch.float16
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.float16
    config.dtype = torch.float32  # half-precision kernels on GPU: a float32 checkpoint is served in bf16
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", config, CPU) == torch.bfloat16
    assert resolve_dtype("float16", config, CPU) == torch.float16
    assert resolve_dtype("float32", config, torch.device("cuda")) == torch.float32
    with pytest.raises(ModelLoadError, match="dtype must be"):
        resolve_dtype("int8", config, CPU)


def test_sliding_window_shorter_than_context_caps_the_servable_length(tmp_path):
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                           sliding_window=32)
    config.save_pretrained(tmp_path)
    assert load(tmp_path, load_format="dummy").max_position_embeddings == 32
    config.sliding_window = None
    config.save_pretrained(tmp_path)
    assert load(tmp_path, load_format="dummy").max_position_embeddings == 128


def test_unsupported_rope_type_is_a_clear_error(tmp_path):
    config = tiny_llama().config
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="rope type 'dynamic' is not supported"):
        load(tmp_path, load_format="dummy")


def test_weight_loaders_give_each_tensor_parallel_rank_its_slice():
    """Only TP=1 runs today, but the loaders already shard: check the slices each rank would keep."""
    from pagoda_engine.worker.model.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    hidden, d = 8, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, hidden, generator=gen) for n in (8, 2, 2))
    for tp in (2, 4):  # 4 ranks over 2 KV heads: each KV head is replicated on two ranks
        for rank in range(tp):
            layer = QKVParallelLinear(hidden, d, 8, 2, tp_size=tp, tp_rank=rank)
            for shard, w in zip("qkv", (q, k, v)):
                layer.weight.weight_loader(layer.weight, w, shard)
            heads = 8 // tp
            kv_head = rank * 2 // tp
            expected = torch.cat([q[rank * heads * d:(rank + 1) * heads * d],
                                  k[kv_head * d:(kv_head + 1) * d], v[kv_head * d:(kv_head + 1) * d]])
            assert torch.equal(layer.weight, expected)

    gate, up = torch.randn(6, hidden, generator=gen), torch.randn(6, hidden, generator=gen)
    for rank in range(2):
        layer = MergedColumnParallelLinear(hidden, [6, 6], tp_size=2, tp_rank=rank)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        assert torch.equal(layer.weight, torch.cat([gate[3 * rank:3 * rank + 3], up[3 * rank:3 * rank + 3]]))

    down, x = torch.randn(hidden, 6, generator=gen), torch.randn(3, 6, generator=gen)
    partial_sums = []
    for rank in range(2):
        layer = RowParallelLinear(6, hidden, tp_size=2, tp_rank=rank)
        layer.weight.weight_loader(layer.weight, down)
        partial_sums.append(torch.nn.functional.linear(x[:, 3 * rank:3 * rank + 3], layer.weight))
    torch.testing.assert_close(partial_sums[0] + partial_sums[1], x @ down.T)
