"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

Owns `load_gguf_config` (a transformers config built from the file's metadata, as transformers'
own GGUF support builds it) and `gguf_tensors` (every weight under its Hugging Face checkpoint
name, dequantized to float32 on the CPU when the loader asks for it). The loader then fills the
model through the same weight loaders as safetensors, converting to the serving dtype and moving
to the device on the way. Dense Llama (Mistral GGUFs say llama too), Qwen2 and Qwen3 files load,
and so do their mixture-of-experts kinds: Mixtral (a llama file with experts), Qwen2-MoE (with its
gated shared expert) and Qwen3-MoE.

Rotary scaling comes as llama.cpp writes it: linear and YaRN as metadata (`rope.scaling.*`, made
into the config's `rope_scaling`), Llama 3.1's as a `rope_freqs` tensor of per-dimension
frequency divisors, which the config carries as `rope_freq_factors` and the rotary embedding
applies as llama.cpp does (each dimension's frequency divided by its factor).

llama.cpp stacks each layer's experts in one tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, [experts, rows, columns]); `gguf_tensors` hands them out one expert
at a time under the Hub's per-expert names (`mlp.experts.<e>.gate_proj.weight`), dequantizing each
stacked tensor once, so MoE weights take the same loader path as a safetensors checkpoint. Mixtral
files from before the stacking (`blk.<layer>.ffn_gate.<expert>.weight`) load too. The
routing follows llama.cpp's for each architecture: Mixtral and Qwen3-MoE renormalise the top-k
weights, Qwen2-MoE does not; every layer has experts, as llama.cpp requires.

llama.cpp's converter permutes Llama's q/k projection rows (rotary halves interleaved, its rope
layout); `_unpermute` undoes that, as transformers' GGUF loader does.
"""

from __future__ import annotations

import re
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from pagoda_engine.errors import ModelLoadError, UnsupportedArchitectureError

# general.architecture → transformers' model_type (a llama file with experts is Mixtral).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe"}
# llama.cpp's routing for each MoE architecture: whether the top-k weights are renormalised
# (its build_moe_ffn's norm_w, fixed per architecture).
_RENORMALISES_TOP_K = {"llama": True, "qwen2moe": False, "qwen3moe": True}

# {arch}.<key> → the transformers config field it sets.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}

# GGUF tensor names (llama.cpp's gguf-py TensorNameMap) → Hugging Face checkpoint names.
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked expert tensors → the Hub's per-expert projection names.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's first Mixtral layout (files converted before its experts were stacked): one tensor
# per expert and projection, `blk.<layer>.ffn_gate.<expert>.weight`.
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def open_gguf(file: Path):
    """A `gguf.GGUFReader` over `file` (memory-mapped); a file that is not GGUF, or is cut short,
    is a ModelLoadError. The config and the weights share one reader: parsing the metadata (a
    vocabulary of 50,000 strings, one by one) takes seconds."""
    stat = file.stat()
    return _reader(str(file.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ModelLoadError(f"cannot read {path}: not a valid GGUF file, or truncated "
                             f"({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def load_gguf_config(file: Path) -> PretrainedConfig:
    """The transformers config of a GGUF file, from its metadata."""
    reader = open_gguf(file)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{file.name} holds a {arch!r} GGUF model; Pagoda loads GGUF files of "
                                           f"{', '.join(GGUF_ARCHITECTURES)} (or the same models as safetensors)")
    tensor_names = {t.name for t in reader.tensors}
    fields = {ours: _field(reader, f"{arch}.{key}") for key, ours in _CONFIG_KEYS.items()}
    fields = {k: v for k, v in fields.items() if v is not None}
    missing = [f"{arch}.{key}" for key, ours in _CONFIG_KEYS.items()
               if ours in ("hidden_size", "num_hidden_layers", "num_attention_heads") and ours not in fields]
    if missing:
        raise ModelLoadError(f"{file.name}: the GGUF metadata lacks {', '.join(missing)}")
    # The head size: explicit (key_length) where the converter wrote it, else the rotary
    # dimension (Llama rotates whole heads), else hidden size over heads.
    head_dim = _field(reader, f"{arch}.attention.key_length") or (
        _field(reader, f"{arch}.rope.dimension_count") if arch == "llama" else None)
    if head_dim:
        fields["head_dim"] = int(head_dim)
    if "vocab_size" not in fields:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{file.name}: the GGUF metadata gives no vocabulary size")
        fields["vocab_size"] = len(tokens.data)
    for key, ours in _TOKEN_ID_KEYS.items():
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            fields[ours] = int(value)
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names
    fields.update(_rope_fields(file, reader, arch))
    model_type = GGUF_ARCHITECTURES[arch]
    if arch in _RENORMALISES_TOP_K and (arch != "llama" or _field(reader, "llama.expert_count", 0)):
        model_type = "mixtral" if arch == "llama" else model_type
        fields.update(_moe_fields(file, reader, arch, tensor_names, fields))
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # a value of the wrong type in the metadata
        raise ModelLoadError(f"{file.name}: cannot build a config from the GGUF metadata: {e}") from e


def _rope_fields(file: Path, reader, arch: str) -> dict:
    """`rope_scaling` from llama.cpp's `rope.scaling.*` metadata (linear, YaRN), and
    `rope_freq_factors` from a `rope_freqs` tensor (Llama 3.1's scaling, as the converter writes
    it); anything else is refused by name rather than served with the wrong positions."""
    out = {}
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    unsupported = [key for key in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier")
                   if f"{arch}.rope.scaling.{key}" in reader.fields]
    if kind not in ("none", "linear", "yarn") or (kind != "none" and not factor) or unsupported:
        raise ModelLoadError(f"{file.name}: rotary-embedding scaling {kind!r} "
                             f"({', '.join(unsupported) or f'factor {factor}'}) is not supported in GGUF files "
                             "(linear and YaRN by factor are; or load the model's safetensors directory)")
    if kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            value = _field(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = float(value)
        out["rope_scaling"] = scaling
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        out["rope_freq_factors"] = [float(x) for x in _dequantize(freqs, None).flatten()]
    return out


def _moe_fields(file: Path, reader, arch: str, tensor_names: set[str], fields: dict) -> dict:
    """The config fields of a mixture-of-experts file (Mixtral's or Qwen-MoE's names), as
    llama.cpp reads its metadata: the experts' FFN size falls back to feed_forward_length (Mixtral
    writes only that) and the shared expert's to feed_forward_length too."""
    num_experts = int(_field(reader, f"{arch}.expert_count", 0))
    top_k = int(_field(reader, f"{arch}.expert_used_count", 0))
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(f"{file.name}: the GGUF metadata gives {num_experts} experts, {top_k} used per token")
    scale = _field(reader, f"{arch}.expert_weights_scale", 0.0)
    if scale not in (0.0, 1.0):
        raise ModelLoadError(f"{file.name}: scaled expert weights ({arch}.expert_weights_scale = {scale}) are not "
                             "supported")
    ffn = fields.get("intermediate_size")
    num_layers = fields["num_hidden_layers"]
    moe_layers = sum(f"blk.{i}.ffn_gate_exps.weight" in tensor_names or f"blk.{i}.ffn_gate.0.weight" in tensor_names
                     for i in range(num_layers))
    if moe_layers != num_layers:  # llama.cpp's MoE architectures have experts in every layer
        raise ModelLoadError(f"{file.name}: experts in {moe_layers} of {num_layers} layers; an MoE GGUF file needs "
                             "them in every layer")
    if arch == "llama":
        return dict(num_local_experts=num_experts, num_experts_per_tok=top_k)
    out = dict(num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=_RENORMALISES_TOP_K[arch],
               moe_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length", 0) or ffn // top_k))
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(
            _field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or ffn)
    return out


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor (None: a tensor Pagoda has no name for)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    expert = _EXPERT_TENSOR.fullmatch(gguf_name)
    if expert:
        return f"model.layers.{expert[1]}.mlp.experts.{expert[3]}.{expert[2]}_proj.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"
    return None


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, its rows go from [pairs, 2] order back to
    [2, pairs] (Hugging Face's rotate-half layout)."""
    pairs = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, pairs, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _dequantize(tensor, num_heads: int | None) -> torch.Tensor:
    from gguf import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {e}") from e
    if num_heads is not None:
        weights = _unpermute(weights, num_heads)
    # Copied only where still the file's (read-only, memory-mapped) bytes: F32 tensors.
    return torch.from_numpy(np.require(weights, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


class _StackedExperts:
    """One of llama.cpp's stacked expert tensors, [experts, rows, columns], dequantized on the
    first expert asked for and handed out an expert at a time."""

    def __init__(self, tensor):
        self.tensor = tensor
        self._weights: torch.Tensor | None = None

    def expert(self, e: int) -> torch.Tensor:
        if self._weights is None:
            self._weights = _dequantize(self.tensor, None)
        return self._weights[e]


def _row_vector(tensor) -> torch.Tensor:
    """Qwen2-MoE's shared-expert gate, [1, hidden] as the Hub holds it, whether the file kept
    that shape or llama.cpp's one dimension."""
    return _dequantize(tensor, None).reshape(1, -1)


def gguf_tensors(file: Path, hf_config: PretrainedConfig) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(checkpoint name, read) for every tensor of a GGUF file, a stacked expert tensor as one
    entry per expert; `read()` dequantizes to a float32 CPU tensor, so weights another rank or
    pipeline stage skips are never dequantized. A tensor without a Hugging Face name keeps its
    GGUF name (the loader reports it as unexpected)."""
    reader = open_gguf(file)
    permute = _field(reader, "general.architecture") == "llama"
    heads = {"attn_q": hf_config.num_attention_heads, "attn_k": hf_config.num_key_value_heads}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # in the config (`rope_freq_factors`), not a weight
            continue
        layer_tensor = _LAYER_TENSOR.fullmatch(tensor.name)
        kind = layer_tensor[2] if layer_tensor else None
        if kind in _EXPERT_TENSORS and layer_tensor[3] == "weight":
            stacked = _StackedExperts(tensor)
            prefix = f"model.layers.{layer_tensor[1]}.mlp.experts"
            for e in range(int(tensor.shape[-1])):  # GGUF lists dimensions innermost first: experts last
                yield f"{prefix}.{e}.{_EXPERT_TENSORS[kind]}.weight", partial(stacked.expert, e)
            continue
        num_heads = heads.get(kind) if permute else None
        read = partial(_row_vector, tensor) if kind == "ffn_gate_inp_shexp" else partial(_dequantize, tensor, num_heads)
        yield hf_tensor_name(tensor.name) or tensor.name, read
