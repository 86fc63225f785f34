"""GGUF files of tiny Hugging Face models, written as llama.cpp's converter (convert_hf_to_gguf.py)
writes them, with the `gguf` package's writer: its metadata keys, its tensor names, for Llama (and
Mixtral) its permutation of the q/k rows, its forms of rope scaling (Llama 3.1's `rope_freqs`
tensor, linear and YaRN metadata), and for mixture-of-experts models its expert metadata and each
layer's experts stacked in one tensor per projection. Not a test module: tests import it by
name (as random_weights)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import (MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType,
                  get_tensor_name_map, quantize)

_ARCH = {"llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3,
         "mixtral": MODEL_ARCH.LLAMA, "qwen2_moe": MODEL_ARCH.QWEN2MOE, "qwen3_moe": MODEL_ARCH.QWEN3MOE}


def gguf_name(hf_name: str, arch: MODEL_ARCH, num_layers: int) -> str:
    """llama.cpp's name for a Hugging Face tensor (gguf-py's own name map, not Pagoda's)."""
    stem, suffix = hf_name.rsplit(".", 1)
    return f"{get_tensor_name_map(arch, num_layers).get_name(stem)}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from rotate-half order to interleaved pairs."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add_tokenizer(writer: GGUFWriter, tokenizer_dir: Path) -> None:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's `gpt2` tokenizer model."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(special[config["bos_token"]])
    writer.add_eos_token_id(special[config["eos_token"]])
    writer.add_pad_token_id(special[config["pad_token"]])
    writer.add_add_bos_token(True)
    writer.add_chat_template(config["chat_template"])


def _add_experts(writer: GGUFWriter, cfg) -> None:
    """The MoE metadata llama.cpp's converter writes (Mixtral's expert size is its
    feed_forward_length)."""
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if hasattr(cfg, "moe_intermediate_size"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def llama3_rope_factors(cfg, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3.1's rope scaling: each
    frequency's divisor (1 for short wavelengths, `factor` for long ones, smooth between)."""
    params = cfg.rope_parameters
    freqs = 1.0 / (params["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    original = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    factors = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_rope_scaling(writer: GGUFWriter, cfg, head_dim: int) -> None:
    """Rope scaling as the converter writes it: linear and YaRN as metadata, Llama 3.1's as a
    `rope_freqs` tensor."""
    params = cfg.rope_parameters
    kind = params.get("rope_type", "default")
    if kind == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    elif kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    elif kind != "default":
        raise ValueError(f"no GGUF form for rope type {kind!r}")


def _checkpoint_tensors(hf_model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under the Hub's names, as the converter reads them, an MoE layer's
    experts stacked per projection (`mlp.experts.gate_proj.weight` [experts, rows, columns]):
    transformers holds them fused (`experts.gate_up_proj`, gate rows first)."""
    out = []
    for name, tensor in hf_model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out += [(name.replace("gate_up_proj", "gate_proj.weight"), gate),
                    (name.replace("gate_up_proj", "up_proj.weight"), up)]
        elif name.endswith(".experts.down_proj"):
            out.append((name + ".weight", tensor))
        elif name.endswith(".shared_expert_gate.weight"):  # [1, hidden] on the Hub, [hidden] in llama.cpp's files
            out.append((name, tensor.reshape(-1)))
        else:
            out.append((name, tensor))
    return out


def _per_expert(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A stacked expert tensor (`model.layers.<l>.mlp.experts.<proj>.weight`) as llama.cpp's first
    Mixtral layout held it: (GGUF name, matrix) per expert."""
    layer, proj = name.split(".")[2], name.split(".")[-2].removesuffix("_proj")
    return [(f"blk.{layer}.ffn_{proj}.{e}.weight", expert) for e, expert in enumerate(data)]


def write_gguf(hf_model, path: Path, tokenizer_dir: Path | None = None,
               quantization: GGMLQuantizationType = GGMLQuantizationType.F32, per_expert: bool = False) -> Path:
    """`hf_model` (a transformers model) as a GGUF file at `path`; 2-D weights and stacked experts
    in `quantization` (norms and biases stay F32, as llama.cpp keeps them), a tied lm_head left
    out; `per_expert`: experts one tensor each, as llama.cpp's converter wrote Mixtral at first."""
    cfg = hf_model.config
    arch = _ARCH[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {cfg.model_type}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    _add_rope_scaling(writer, cfg, head_dim)
    if hasattr(cfg, "num_experts_per_tok"):
        _add_experts(writer, cfg)
    if tokenizer_dir is not None:
        _add_tokenizer(writer, tokenizer_dir)
    for name, tensor in _checkpoint_tensors(hf_model):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().to(torch.float32).numpy()
        if arch == MODEL_ARCH.LLAMA and ".self_attn.q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == MODEL_ARCH.LLAMA and ".self_attn.k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        pieces = (_per_expert(name, data) if per_expert and ".experts." in name
                  else [(gguf_name(name, arch, cfg.num_hidden_layers), data)])
        for name, data in pieces:
            if data.ndim >= 2 and quantization != GGMLQuantizationType.F32:
                writer.add_tensor(name, quantize(data, quantization), raw_dtype=quantization)
            else:
                writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
