"""EAGLE-3 heads (Li et al., 2025) in the checkpoint format their authors publish and vLLM loads
(`LlamaForCausalLMEagle3`, vLLM's `llama_eagle3.py`):

    config.json: hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
                 rms_norm_eps, rope settings, vocab_size (the target's), draft_vocab_size,
                 optional target_hidden_size, norm_before_residual, eagle_config
    weights:     fc.weight [H, 3 * H_target]; midlayer.{input_layernorm, hidden_norm,
                 post_attention_layernorm}.weight; midlayer.self_attn.{q,k,v,o}_proj.weight (q, k,
                 v over 2 * H inputs); midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
                 lm_head.weight [draft_vocab, H]; d2t [draft_vocab] (target id = draft id + d2t);
                 t2d (unused); embed_tokens.weight optional (else the target's embedding)

One decoder layer: the token's embedding (input_layernorm) concatenated with the normalised
input hidden state (hidden_norm; the un-normalised one is the residual) goes through attention,
then the MLP as any Llama layer; the final norm's output gives the logits over the draft
vocabulary, its input (the pre-norm hidden state) is the next draft step's input hidden state.
The first step's input hidden state is `fc` of the target's hidden states at three layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.worker.attention.base import AttentionBackend, KVCacheSpec
from pagoda_engine.worker.model.layers import (ColumnParallelLinear, GatedMLP, ParallelLMHead, QKVParallelLinear, RMSNorm,
                                               RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding)
from pagoda_engine.worker.model.loader import _default_dtype, _init_dummy, _load_checkpoint, _safetensors_tensors
from pagoda_engine.worker.model.models.llama import head_dim, rope_settings

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, rotary: RotaryEmbedding):
        super().__init__()
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = head_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = nn.Module()  # the checkpoint's names: self_attn.{q,k,v,o}_proj
        self.self_attn.qkv_proj = QKVParallelLinear(2 * hidden, self.head_dim, heads, kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.self_attn.qkv_proj.num_heads, self.self_attn.qkv_proj.num_kv_heads
        self.self_attn.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias)
        self.rotary_emb = rotary
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden, attn: AttentionBackend):
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        t = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.self_attn.qkv_proj(torch.cat([embeds, hidden], dim=-1)).split([q_size, kv_size, kv_size], dim=-1)
        o = attn.forward(0, q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim),
                         v.reshape(t, self.num_kv_heads, self.head_dim), positions=positions,
                         rotary=self.rotary_emb, q_norm=None, k_norm=None)
        x = self.self_attn.o_proj(o.reshape(t, q_size))
        x, residual = self.post_attention_layernorm(x, residual.clone())
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """`head(input_ids, positions, hidden [T, H], attn) -> (normed, prenorm)`; `combine(aux [T,
    3 * H_target]) -> [T, H]`; `compute_logits(normed) -> [N, draft_vocab]`; `draft_token_ids`
    maps their argmax to target ids."""

    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: PretrainedConfig, target_hidden_size: int, own_embedding: bool):
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        theta, rope_params = rope_settings(cfg)
        self.rotary_emb = RotaryEmbedding(head_dim(cfg), cfg.max_position_embeddings, theta, rope_params)
        self.midlayer = Eagle3Layer(cfg, self.rotary_emb)
        self.fc = ColumnParallelLinear(3 * (getattr(cfg, "target_hidden_size", None) or target_hidden_size), hidden)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden) if own_embedding else None
        self.target_embed: nn.Module | None = None  # the target's, when the checkpoint has none
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input hidden states the head reads (vLLM's choice)."""
        eagle = getattr(self.config, "eagle_config", None) or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        if ids:
            return tuple(int(i) for i in ids)
        return (2, num_target_layers // 2, num_target_layers - 3)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def forward(self, input_ids, positions, hidden, attn):
        embed = self.embed_tokens if self.embed_tokens is not None else self.target_embed
        x, residual = self.midlayer(positions, embed(input_ids), hidden, attn)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).float()

    def draft_token_ids(self, logits: torch.Tensor) -> torch.Tensor:
        best = logits.argmax(dim=-1)
        return best + self.d2t[best]

    def kv_cache_spec(self, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        a = self.midlayer
        return KVCacheSpec(num_layers=1, num_kv_heads=a.num_kv_heads, num_qo_heads=a.num_heads, head_dim=a.head_dim,
                           page_size=page_size, dtype=dtype)

    def checkpoint_weight_name(self, name: str) -> str | None:
        return name


def load_eagle3_config(model_dir: str) -> PretrainedConfig:
    """An EAGLE-3 head's config.json (its architecture is not one the engine serves as a target)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read the EAGLE-3 head's {path}: {e}") from e
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if not isinstance(architectures, list) or not any(a in ARCHITECTURES for a in architectures):
        named = ", ".join(map(str, architectures)) if architectures else "nothing"
        raise ModelLoadError(f"{model_dir} is not an EAGLE-3 head: config.json names {named}, "
                             f"expected one of {', '.join(ARCHITECTURES)}")
    try:
        return LlamaConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot parse {path}: {e}") from e


def load_eagle3_head(model_dir: str, cfg: PretrainedConfig, target_embed: nn.Module, target_cfg: PretrainedConfig,
                     dtype: torch.dtype, device: torch.device, load_format: str, seed: int) -> Eagle3Head:
    """An EAGLE-3 head from `model_dir` (safetensors, or dummy weights), checked against the target;
    `target_embed`: the target's token embedding, whole, for a head without one of its own."""
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ModelLoadError(f"the EAGLE-3 head {model_dir} drafts for a vocabulary of {cfg.vocab_size} tokens, the "
                             f"target's has {target_cfg.vocab_size}")
    # A head is small: read whole (the files close once read).
    tensors = {} if load_format == "dummy" else {name: read() for _, name, read in
                                                 _safetensors_tensors(Path(model_dir), device)}
    own_embedding = "embed_tokens.weight" in tensors
    if not own_embedding and cfg.hidden_size != target_cfg.hidden_size:
        raise ModelLoadError(f"the EAGLE-3 head {model_dir} has no embedding of its own, so it embeds tokens with the "
                             f"target's ({target_cfg.hidden_size} wide), but its hidden size is {cfg.hidden_size}")
    with _default_dtype(dtype), torch.device(device):
        head = Eagle3Head(cfg, target_cfg.hidden_size, own_embedding)
    if load_format == "dummy":
        _init_dummy(head, seed, device)
    else:
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        if d2t is None and head.draft_vocab_size != cfg.vocab_size:
            raise ModelLoadError(f"{model_dir} has a draft vocabulary of {head.draft_vocab_size} tokens but no d2t map")
        weights = ((Path(model_dir).name, name.replace("layers.0.", "midlayer."), lambda t=tensor: t)
                   for name, tensor in tensors.items())
        _load_checkpoint(head, weights, model_dir)
        if d2t is not None:
            d2t = d2t.to(device=device, dtype=torch.int64)
            if d2t.shape != head.d2t.shape:
                raise ModelLoadError(f"{model_dir}: d2t has shape {tuple(d2t.shape)}, expected ({head.draft_vocab_size},)")
            head.d2t.copy_(d2t)
    if not own_embedding:  # after loading: the target's weights are not the head's to load or draw
        head.target_embed = target_embed
    num_layers = target_cfg.num_hidden_layers
    if any(not 0 <= i < num_layers for i in head.aux_layers(num_layers)):
        raise ModelLoadError(f"the EAGLE-3 head {model_dir} reads the target's layers {head.aux_layers(num_layers)}, "
                             f"but the target has {num_layers}")
    ids = torch.arange(head.draft_vocab_size, device=device) + head.d2t
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ModelLoadError(f"{model_dir}: d2t maps draft ids outside the target's vocabulary of {cfg.vocab_size}")
    head.requires_grad_(False)
    return head.eval()
